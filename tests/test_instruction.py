"""The instruction matters: dt decoys, instruction=swap|blank, wrong_target and wrong_object."""

from __future__ import annotations

import json

import numpy as np
import pytest

from robopolicy.config import ConfigError
from robopolicy.envs import EnvConfig
from robopolicy.eval import EvalConfig, evaluate
from robopolicy.eval.oracle_policy import OraclePolicy
from robopolicy.eval.report import summarize_split
from sim_envs.arm.env import ArmPickPlaceEnv
from sim_envs.person_follow import PersonFollowEnv
from sim_envs.person_follow import metrics as M
from sim_envs.person_follow.scenario import generate_scenario, decoy_at_start

PF = "robopolicy/PersonFollow-v0"
PP = "robopolicy/ArmPickPlace-v0"


def _starts(info) -> np.ndarray:
    """People's t=0 poses from the env's info, the target first."""
    rows = [int(info["target_index"])] + [k for k in np.flatnonzero(info["people_mask"]) if k != info["target_index"]]
    return info["people_poses"][rows]


def _drive(env, obs, info, follow_slot=None):
    """Run the oracle to the episode's end, following ``follow_slot`` instead of the target when given."""
    oracle = env.make_oracle()
    seen = (lambda i: {**i, "target_index": follow_slot}) if follow_slot is not None else (lambda i: i)
    oracle.reset(obs, seen(info))
    while True:
        obs, _r, term, trunc, info = env.step(oracle.act(obs, seen(info)).action)
        if term or trunc:
            return info["episode_metrics"]


# ----------------------------------------------------------------------------- dt decoys
def test_dt_starts_with_a_decoy_in_at_least_half_of_200_episodes_and_other_splits_never():
    dt = [generate_scenario(np.random.default_rng(s), "dt", 300, 0.1) for s in range(200)]
    share = np.mean([decoy_at_start(sc.robot_start, np.stack([tr[0] for tr in sc.trajs])) for sc in dt])
    assert share >= 0.5, share
    for split in ("stt", "at"):  # the target stays the most central person at t=0
        for s in range(20):
            sc = generate_scenario(np.random.default_rng(s), split, 300, 0.1)
            assert not decoy_at_start(sc.robot_start, np.stack([tr[0] for tr in sc.trajs]))
    env = PersonFollowEnv(split="dt", camera=False)  # what the env shows at t=0 is the scenario's start
    hits = []
    for seed in range(6):
        _obs, info = env.reset(seed=seed)
        hits.append(decoy_at_start(info["robot_pose"], _starts(info)))
        assert hits[-1] == decoy_at_start(env.scenario.robot_start, np.stack([tr[0] for tr in env.scenario.trajs]))
        assert info["target_visible"]  # the target is in view even when the robot faces between the two
    assert any(hits)


def test_following_the_decoy_is_a_wrong_target_and_the_oracle_never_is():
    env = PersonFollowEnv(split="dt", camera=False)
    for seed in (0, 6):  # decoy episodes
        obs, info = env.reset(seed=seed)
        assert decoy_at_start(info["robot_pose"], _starts(info))
        m = _drive(env, obs, info, follow_slot=int(env._slots[1]))
        assert m["wrong_target"] and not m["success"], m
        obs, info = env.reset(seed=seed)
        m = _drive(env, obs, info)
        assert m["success"] and not m["wrong_target"], m


def test_followed_person_is_the_most_central_one_in_follow_range_and_view():
    far, hidden = M.FOLLOW_MAX_DISTANCE + 0.1, M.VISIBLE_MIN_FRACTION - 0.01
    assert M.followed_person([2.0, 2.0], [1.0, 1.0], [0.3, -0.1]) == 1
    assert M.followed_person([2.0, far], [1.0, 1.0], [0.3, -0.1]) == 0  # the other is out of range
    assert M.followed_person([2.0, 2.0], [1.0, hidden], [0.3, 0.0]) == 0  # ... or not in view
    assert M.followed_person([far, 2.0], [1.0, hidden], [0.0, 0.0]) is None
    eps = [dict(success=True, collision=False, lost=False, following_steps=5, steps=5, reference_steps=5,
                wrong_target=w, retargeted=r) for w, r in ((True, True), (False, True), (False, False), (False, False))]
    eps[1]["success"] = False
    s = M.summarize_episodes(eps)
    assert s["wrong_target_rate"] == 0.25 and s["retargeted_rate"] == 0.5 and s["retargeted_success_rate"] == 0.5


# ----------------------------------------------------------------------------- swap
def test_swap_keeps_the_scene_and_names_a_visible_person_who_becomes_the_target():
    normal = PersonFollowEnv(split="dt", camera=False)
    swap = PersonFollowEnv(split="dt", camera=False, instruction="swap")
    swapped = 0
    for seed in (0, 1, 6, 8):  # 0, 6 and 8 start with a decoy
        obs_n, info_n = normal.reset(seed=seed)
        obs_s, info_s = swap.reset(seed=seed)
        for key in ("robot_pose", "people_poses", "people_mask", "obstacles"):  # the same scene
            np.testing.assert_array_equal(info_n[key], info_s[key])
        if not swap._retargeted:
            assert obs_s["task"] == obs_n["task"] and info_s["target_index"] == info_n["target_index"]
            continue
        swapped += 1
        new = swap.scenario.people[0]
        assert info_s["target_index"] != info_n["target_index"] and obs_s["task"] != obs_n["task"]
        assert new.shirt in obs_s["task"] and new.trousers in obs_s["task"]
        assert info_s["target_visible"] and info_s["target_distance"] <= M.FOLLOW_MAX_DISTANCE
        assert sum(p.attributes() == new.attributes() for p in swap.scenario.people) == 1
    assert swapped >= 3
    _obs, _info = swap.reset(seed=0, options={"instruction": "normal"})  # a reset option too
    assert not swap._retargeted and _obs["task"] == normal.reset(seed=0)[0]["task"]
    obs, info = swap.reset(seed=0)
    assert swap._retargeted
    m = _drive(swap, obs, info)  # the oracle follows the new target
    assert m["success"] and m["retargeted"] and not m["wrong_target"], m
    with pytest.raises(ValueError, match="instruction"):
        PersonFollowEnv(instruction="other")


# ----------------------------------------------------------------------------- evaluation
class RecordingOracle(OraclePolicy):
    """The oracle stand-in, remembering the instructions the policy side was given."""

    def __init__(self, action_dim):
        super().__init__(action_dim)
        self.tasks = []

    def predict(self, batch):
        self.tasks += list(batch["task"])
        return super().predict(batch)


def _pf_cfg(tmp_path, env_kwargs=None, **kw):
    base = dict(env=EnvConfig(PF, {"camera": False, **(env_kwargs or {})}), splits=["dt"], episodes=2, workers=1, videos=0,
                out=str(tmp_path / "eval"), progress=False)
    base.update(kw)
    return EvalConfig(**base)


def test_eval_instruction_modes_and_the_oracle_through_the_evaluation_loop(tmp_path):
    blank = RecordingOracle(2)
    evaluate(blank, _pf_cfg(tmp_path, {"max_steps": 3}, instruction="blank"), log=lambda m: None, save=False)
    assert blank.tasks and set(blank.tasks) == {""}
    normal = RecordingOracle(2)
    evaluate(normal, _pf_cfg(tmp_path, {"max_steps": 3}), log=lambda m: None, save=False)
    assert all(t.strip() for t in normal.tasks)

    report = evaluate(OraclePolicy(2), _pf_cfg(tmp_path, instruction="swap"), log=lambda m: None)
    summary = report.splits[0].summary
    assert summary["success_rate"] == 1.0 and summary["wrong_target_rate"] == 0.0 and summary["retargeted_rate"] > 0
    table = report.table()
    assert "wrong target %" in table and "retargeted %" in table
    record = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert record["metrics"]["dt"]["wrong_target_rate"] == 0.0
    assert "Instruction: swap" in (tmp_path / "eval" / "eval.md").read_text()

    with pytest.raises(ConfigError, match="instruction=swap"):
        evaluate(OraclePolicy(6), EvalConfig(env=EnvConfig(PP), instruction="swap", episodes=1, progress=False),
                 log=lambda m: None, save=False)
    with pytest.raises(ValueError, match="instruction"):
        EvalConfig(instruction="shuffle")


# ----------------------------------------------------------------------------- PickPlace wrong_object
def _pickplace_episode(env, seed, wrong: bool) -> dict:
    """The oracle, or the oracle sent to the next cube (a scripted policy that picks the wrong one)."""
    obs, info = env.reset(seed=seed)
    goal = (lambda i: {**i, "goal_cube": (int(i["goal_cube"]) + 1) % env.num_cubes}) if wrong else (lambda i: i)
    oracle = env.make_oracle()
    oracle.reset(obs, goal(info))
    steps = 0
    while True:
        obs, _r, term, trunc, info = env.step(oracle.act(obs, goal(info)).action)
        steps += 1
        if term or trunc:
            return {"seed": seed, "steps": steps, "success": info["is_success"], "episode_metrics": info["episode_metrics"]}


def test_pickplace_counts_a_lifted_cube_other_than_the_named_one(tmp_path):
    env = ArmPickPlaceEnv(use_cameras=False)
    right = [_pickplace_episode(env, s, wrong=False) for s in range(3)]
    wrong = [_pickplace_episode(env, s, wrong=True) for s in range(3)]
    assert summarize_split(PP, right)["wrong_object_rate"] == 0.0
    assert summarize_split(PP, right)["success_rate"] == 1.0
    assert summarize_split(PP, wrong)["wrong_object_rate"] == 1.0

    from robopolicy.cli import main

    out = tmp_path / "pp"
    assert main(["eval", "--checkpoint", "oracle", "--env", PP, "--episodes", "2", "--videos", "0", "--out", str(out),
                 "--no-progress"]) == 0
    record = json.loads((out / "summary.json").read_text())
    assert record["metrics"]["ArmPickPlace-v0"]["wrong_object_rate"] == 0.0
    assert "wrong object %" in (out / "eval.md").read_text()
