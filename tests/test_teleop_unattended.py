"""Unattended collection: the scripted reset behaviour rearranges the PickPlace scene into a new
layout without env.reset, the layout check catches resets that did not happen, and
``robopolicy collect --unattended`` records forward episodes on one world, retrying failed resets
and counting hard env.resets."""

from __future__ import annotations

import json

import gymnasium
import numpy as np
import pytest

import sim_envs  # noqa: F401  (registers the tasks)
from sim_envs.arm.env import ArmPickPlaceEnv
from sim_envs.arm.rearrange import (Layout, ScriptedRearrange, begin_episode, check_layout, reachable,
                                    sample_layout)


def _env(**kw):
    return gymnasium.make("robopolicy/ArmPickPlace-v0", use_cameras=False, **kw).unwrapped


def _cubes(env):
    return env.data.xpos[env._cube_body].copy()


def test_the_arm_rearranges_the_scene_to_a_new_layout_without_a_reset():
    env = _env()
    env.reset(seed=3)
    rng = np.random.default_rng(0)
    bowls = env.data.mocap_pos[env._target_mocap].copy()
    for k in range(3):
        before = _cubes(env)
        layout = sample_layout(env, rng)
        assert layout.cube_xy.shape == (3, 2)
        assert check_layout(env, layout).ok is False  # a new layout: the scene does not match it yet
        steps = ScriptedRearrange(seed=k).rearrange(env, layout)
        check = check_layout(env, layout)
        assert check.ok, check.reason
        assert steps > 50 and max(check.errors) < 0.015
        moved = np.linalg.norm(_cubes(env)[:, :2] - before[:, :2], axis=1)
        assert moved.max() > 0.02  # a new layout, reached by carrying the cubes there
        obs, info = begin_episode(env, layout)
        assert (info["goal_cube"], info["goal_target"]) == (layout.goal_cube, layout.goal_target)
        assert obs["task"] == (f"put the {env.cube_colors[layout.goal_cube]} cube in the "
                               f"{env.target_colors[layout.goal_target]} bowl")
        assert env._steps == 0 and not info["is_success"]
    np.testing.assert_allclose(env.data.mocap_pos[env._target_mocap], bowls)  # the bowls stay on the table


def test_the_layout_check_catches_a_reset_that_did_not_happen():
    env = _env()
    env.reset(seed=0)
    layout = sample_layout(env, np.random.default_rng(1))
    for i, xy in enumerate(layout.cube_xy):  # put the cubes in place by hand: the check passes
        env._set_cube(i, xy, 0.0)
    env.data.qvel[:] = 0.0
    import mujoco

    mujoco.mj_forward(env.model, env.data)
    assert check_layout(env, layout).ok
    shifted = Layout(layout.cube_xy + [[0.03, 0.0], [0, 0], [0, 0]], layout.goal_cube, layout.goal_target)
    check = check_layout(env, shifted)
    assert not check.ok and check.kind == "off_place" and check.recoverable and "3.0 cm" in check.reason
    env._set_cube(1, np.array([0.30, 0.0]), 0.0)  # knocked beyond the arm's reach
    mujoco.mj_forward(env.model, env.data)
    check = check_layout(env, layout)
    assert not check.ok and check.kind == "out_of_reach" and not check.recoverable
    assert not reachable(np.array([0.30, 0.0, 0.0125])) and reachable(np.array([0.2, 0.05, 0.0125]))


def test_sampled_goals_keep_to_the_split():
    env = _env(split="train")
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(30):
        lay = sample_layout(env, rng)
        assert (env.cube_colors[lay.goal_cube], env.target_colors[lay.goal_target]) not in ArmPickPlaceEnv.HELDOUT_PAIRS


class _Idle:
    """A reset behaviour that never moves the arm (every reset fails)."""

    def rearrange(self, env, layout):
        return 0


class _EveryOther:
    """The scripted reset, skipping every other call: each reset succeeds on its second try."""

    def __init__(self):
        self.inner, self.calls = ScriptedRearrange(seed=0), 0

    def rearrange(self, env, layout):
        self.calls += 1
        return self.inner.rearrange(env, layout) if self.calls % 2 == 0 else 0


def idle_reset(seed):
    return _Idle()


def every_other_reset(seed):
    return _EveryOther()


@pytest.fixture
def reset_calls(monkeypatch):
    calls = []
    original = ArmPickPlaceEnv.reset

    def counting(self, *a, **kw):
        calls.append(kw.get("seed"))
        return original(self, *a, **kw)

    monkeypatch.setattr(ArmPickPlaceEnv, "reset", counting)
    return calls


def _run(tmp_path, capsys, *extra):
    from robopolicy.cli import main

    out = tmp_path / "ds"
    code = main(["collect", "--unattended", "--env", "robopolicy/ArmPickPlace-v0", "--episodes", "3", "--out", str(out),
                 "env.kwargs.use_cameras=false", *extra])
    return code, out, capsys.readouterr().out


def test_collect_unattended_records_episodes_on_one_world(tmp_path, capsys, reset_calls):
    pytest.importorskip("lerobot")
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    code, out, text = _run(tmp_path, capsys)
    assert code == 0 and len(reset_calls) == 1  # the one reset that built the world
    ds = LeRobotDataset("robopolicy/local", root=out)
    assert ds.meta.total_episodes == 3
    assert len({t for t in ds.meta.tasks.index}) >= 2  # each episode a new goal
    record = json.loads((out / "summary.json").read_text())
    m = record["metrics"]
    assert record["kind"] == "collect" and record["episodes"] == 3
    assert (m["resets_attempted"], m["resets_succeeded"], m["hard_resets"]) == (2, 2, 0)
    assert m["episodes_per_hour"] > 0 and m["reset_steps"] > 0 and m["longest_without_env_reset"] == 3
    assert "resets 2/2 succeeded (100.0%), 0 hard env.reset" in text


def test_failed_resets_are_retried_then_recovered_by_a_hard_reset(tmp_path, capsys, reset_calls):
    pytest.importorskip("lerobot")
    code, out, text = _run(tmp_path, capsys, f"reset={__name__}:idle_reset", "retries=2")
    m = json.loads((out / "summary.json").read_text())["metrics"]
    assert code == 0 and m["episodes"] == 3
    assert (m["resets_attempted"], m["resets_succeeded"], m["hard_resets"]) == (4, 0, 2)
    assert m["longest_without_env_reset"] == 1
    assert len(reset_calls) == 3 and sum(m["reset_failures"].values()) == 4  # off its place, or still in a bowl
    assert "hard env.reset #2" in text and "attempt 2/2" in text

    code, out2, _ = _run(tmp_path / "b", capsys, f"reset={__name__}:every_other_reset", "retries=2")
    m = json.loads((out2 / "summary.json").read_text())["metrics"]
    assert (m["resets_attempted"], m["resets_succeeded"], m["hard_resets"]) == (4, 2, 0)
    assert m["longest_without_env_reset"] == 3


def test_a_bad_reset_behaviour_is_a_config_error(tmp_path, capsys):
    from robopolicy.cli import main

    code = main(["collect", "--unattended", "--out", str(tmp_path / "x"), "reset=no_such_module:f"])
    assert code == 2 and "reset: 'no_such_module:f' is neither 'scripted' nor an importable" in capsys.readouterr().err
    code = main(["collect", "--unattended", "--out", str(tmp_path / "y"), "--workers", "2"])
    assert code == 2 and "--workers does not apply" in capsys.readouterr().err


def test_the_shipped_config_loads():
    from robopolicy.config import load_config
    from robopolicy.teleop.unattended import UnattendedConfig

    cfg = load_config(UnattendedConfig, "configs/teleop/unattended_pickplace.yaml")
    assert cfg.env.id == "robopolicy/ArmPickPlace-v0" and cfg.reset == "scripted" and cfg.retries == 3


def test_a_table_with_no_room_for_a_layout_is_a_counted_hard_reset(tmp_path, capsys, reset_calls, monkeypatch):
    import sim_envs.arm.rearrange as rearrange

    def crowded(env, rng):
        raise rearrange.NoLayout("no room on the table for a new layout")

    monkeypatch.setattr(rearrange, "sample_layout", crowded)
    code, out, text = _run(tmp_path, capsys)
    m = json.loads((out / "summary.json").read_text())["metrics"]
    assert code == 0 and (m["resets_attempted"], m["resets_succeeded"], m["hard_resets"]) == (2, 0, 2)
    assert m["reset_failures"] == {"no_room": 2} and len(reset_calls) == 3 and "no room" in text


def test_an_existing_dataset_is_not_overwritten(tmp_path, capsys):
    from robopolicy.cli import main

    (tmp_path / "ds" / "meta").mkdir(parents=True)
    (tmp_path / "ds" / "meta" / "info.json").write_text("{}")
    code = main(["collect", "--unattended", "--env", "robopolicy/ArmPickPlace-v0", "--episodes", "1", "--out",
                 str(tmp_path / "ds"), "env.kwargs.use_cameras=false"])
    assert code == 1 and "a dataset already exists" in capsys.readouterr().out
    code = main(["collect", "--unattended", "--env", "robopolicy/ArmReach-v0", "--out", str(tmp_path / "r")])
    assert code == 2 and "needs an arm task with cubes" in capsys.readouterr().err


def test_the_push_task_is_rearranged_too():
    env = gymnasium.make("robopolicy/ArmPushCube-v0", use_cameras=False).unwrapped
    env.reset(seed=1)
    layout = sample_layout(env, np.random.default_rng(2))
    ScriptedRearrange(seed=0).rearrange(env, layout)
    check = check_layout(env, layout)
    assert check.ok, check.reason
    obs, _ = begin_episode(env, layout)
    assert obs["task"] == f"push the {env.cube_colors[0]} cube to the {env.target_colors[0]} zone"
