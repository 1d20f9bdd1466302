"""robopolicy eval: seeded vectorized rollouts, metrics plumbing, env mapping."""

from __future__ import annotations

import json
import math

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium import spaces

from robopolicy.config import ConfigError
from robopolicy.envs import EnvConfig
from robopolicy.eval import ChunkConfig, EnvMapping, EvalConfig, evaluate
from sim_envs.person_follow.metrics import summarize_episodes
from sim_envs.person_follow.waypoints import arc_waypoints


# ----------------------------------------------------------------------------- test policies
class ConstantPolicy:
    """Predicts the same chunk ``(H, A)`` for every row; counts calls and resets."""

    kind = "action"

    def __init__(self, action, horizon: int = 4):
        self.chunk = torch.as_tensor(action, dtype=torch.float32).expand(horizon, -1)
        self.calls = 0
        self.resets = []
        self.seen = []

    def predict(self, obs):
        self.calls += 1
        self.seen.append({k: (v.shape, v.dtype) if isinstance(v, torch.Tensor) else list(v) for k, v in obs.items()})
        return self.chunk.expand(len(obs["task"]), -1, -1).clone()

    def reset(self):
        self.resets.append(None)


class RowResetPolicy(ConstantPolicy):
    def reset(self, rows=None):
        self.resets.append(rows)


class ArcPolicy:
    """Waypoints of a constant twist: ``(B, K, 3)``."""

    kind = "waypoints"
    num_waypoints = 8

    def __init__(self, v: float, omega: float = 0.0):
        self.wp = torch.from_numpy(arc_waypoints(v, omega, 0.1, self.num_waypoints))

    def predict(self, obs):
        return self.wp.expand(len(obs["task"]), -1, -1).clone()

    def reset(self, rows=None):
        pass


def arm_cfg(tmp_path, **kw) -> EvalConfig:
    base = dict(env=EnvConfig("robopolicy/ArmReach-v0", {"max_steps": 12}), episodes=3, workers=1, videos=0,
                out=str(tmp_path / "eval"), image_size=32, progress=False)
    base.update(kw)
    return EvalConfig(**base)


# ----------------------------------------------------------------------------- rollouts
def test_arm_eval_same_seeds_for_any_worker_count_and_writes_reports(tmp_path):
    cfg1 = arm_cfg(tmp_path / "a", videos=1, episodes=3, workers=1)
    policy = ConstantPolicy(np.zeros(6), horizon=4)
    rep1 = evaluate(policy, cfg1, log=lambda m: None)
    split = rep1.splits[0]
    assert [e["seed"] for e in split.episodes] == [cfg1.seed, cfg1.seed + 1, cfg1.seed + 2]
    assert all(e["steps"] == 12 for e in split.episodes)  # a still arm never reaches: cut at max_steps
    assert split.summary["episodes"] == 3 and split.summary["success_rate"] == 0.0
    assert math.isnan(split.summary["mean_steps_to_success"])
    # chunks of 4 executed whole: one policy call per 4 steps
    assert policy.calls == 3 * 12 // 4
    first = policy.seen[0]
    assert first["observation.images.front"] == (torch.Size([1, 3, 32, 32]), torch.uint8)
    assert first["observation.state"][0] == torch.Size([1, 6])
    assert first["task"][0].startswith("reach")
    data = json.loads((tmp_path / "a" / "eval" / "eval.json").read_text())
    assert data["splits"][0]["summary"]["success_rate"] == 0.0
    assert data["splits"][0]["summary"]["mean_steps_to_success"] is None
    assert "| ArmReach-v0 | 3 | 0.0 |" in (tmp_path / "a" / "eval" / "eval.md").read_text()
    record = json.loads((tmp_path / "a" / "eval" / "summary.json").read_text())
    assert record["kind"] == "eval" and record["episodes"] == 3 and record["seeds"] == [cfg1.seed]
    assert record["metrics"]["ArmReach-v0"]["success_rate"] == 0.0
    assert len(split.videos) == 1
    from robopolicy.utils.video import read_mp4

    frames = read_mp4(split.videos[0])
    assert frames.shape[0] == 13  # the reset frame and one per step

    rep2 = evaluate(ConstantPolicy(np.zeros(6), horizon=4), arm_cfg(tmp_path / "b", episodes=3, workers=2),
                    log=lambda m: None)
    by_seed = {e["seed"]: e for e in rep2.splits[0].episodes}
    for e in split.episodes:
        assert by_seed[e["seed"]]["task"] == e["task"]
        assert by_seed[e["seed"]]["return"] == pytest.approx(e["return"])


def test_policy_reset_per_row_or_in_waves(tmp_path):
    env = EnvConfig("robopolicy/ArmReach-v0", {"max_steps": 5})
    rows = RowResetPolicy(np.zeros(6), horizon=5)
    evaluate(rows, arm_cfg(tmp_path / "r", env=env, episodes=3, workers=2), log=lambda m: None, save=False)
    # both rows start together, then each restarts alone: row resets are given by index
    assert rows.resets[0] is None and all(r in ([0], [1], [0, 1]) for r in rows.resets[1:])
    whole = ConstantPolicy(np.zeros(6), horizon=5)
    rep = evaluate(whole, arm_cfg(tmp_path / "w", env=env, episodes=3, workers=2), log=lambda m: None, save=False)
    assert len(whole.resets) == 2  # two waves: episodes {0, 1} then {2}
    assert [e["seed"] for e in rep.splits[0].episodes] == [100_000, 100_001, 100_002]


def test_person_follow_waypoints_go_through_the_follower_and_tracking_metrics(tmp_path):
    cfg = EvalConfig(env=EnvConfig("robopolicy/PersonFollow-v0", {"max_steps": 25}), splits=["stt", "dt"], episodes=2,
                     workers=1, videos=1, out=str(tmp_path / "pf"), image_size=32, render_size=48, progress=False)
    report = evaluate(ArcPolicy(v=0.0), cfg, log=lambda m: None)
    assert [s.split for s in report.splits] == ["stt", "dt"]
    for split in report.splits:
        metrics = [e["episode_metrics"] for e in split.episodes]
        assert split.summary == summarize_episodes(metrics)
        assert set(split.summary) >= {"success_rate", "tracking_rate", "collision_rate", "lost_rate"}
        assert all(m["steps"] == 25 for m in metrics)
    # the top-down view sits beside the egocentric one: the video is wider than tall
    from robopolicy.utils.video import read_mp4

    frames = read_mp4(report.splits[0].videos[0])
    assert frames.shape[2] >= 2 * 48 - 1
    assert "| stt | 2 |" in report.table() and "TR %" in report.table()
    with pytest.raises(ConfigError, match="ensemble"):
        evaluate(ArcPolicy(v=0.5), EvalConfig(env=cfg.env, splits=["stt"], episodes=1, image_size=32, progress=False,
                                              videos=0, chunk=ChunkConfig(mode="ensemble")), save=False)


def test_an_evaluation_step_cap_still_gives_person_follow_its_episode_metrics(tmp_path):
    # the evaluation's own cap (EvalConfig.max_steps), shorter than the env's: the env is asked for
    # its metrics as of the cut, so the split's summary is complete
    cfg = EvalConfig(env=EnvConfig("robopolicy/PersonFollow-v0", {"max_steps": 40}), splits=["dt"], episodes=2,
                     workers=1, videos=0, out=str(tmp_path / "pf"), image_size=32, render_size=48, progress=False,
                     max_steps=7)
    report = evaluate(ArcPolicy(v=0.0), cfg, log=lambda m: None)
    metrics = [e["episode_metrics"] for e in report.splits[0].episodes]
    assert all(m["steps"] == 7 for m in metrics)
    assert report.splits[0].summary == summarize_episodes(metrics)


def test_wrong_action_dimension_names_the_problem(tmp_path):
    with pytest.raises(ValueError, match="2-D actions but ArmReach-v0 takes actions of shape \\(6,\\)"):
        evaluate(ConstantPolicy(np.zeros(2)), arm_cfg(tmp_path), log=lambda m: None, save=False)


# ----------------------------------------------------------------------------- any gymnasium env
class KnobEnv(gymnasium.Env):
    """Success when the executed action exceeds 1.5; observations under non-LeRobot names."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, render_mode=None):
        self.render_mode = render_mode
        self.observation_space = spaces.Dict({"pixels": spaces.Box(0.0, 1.0, (8, 8, 3), np.float32),
                                              "pos": spaces.Box(-5, 5, (2,), np.float32)})
        self.action_space = spaces.Box(-3.0, 3.0, (1,), np.float32)

    def _obs(self, a):
        return {"pixels": np.full((8, 8, 3), 0.5, np.float32), "pos": np.array([a, -a], np.float32)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(0.0), {}

    def step(self, action):
        self.t += 1
        a = float(np.asarray(action)[0])
        ok = a > 1.5
        return self._obs(a), float(a), ok, self.t >= 50, {"is_success": ok}


def test_any_gymnasium_env_through_the_mapping(tmp_path):
    if "test/Knob-v0" not in gymnasium.registry:
        gymnasium.register("test/Knob-v0", entry_point=KnobEnv)
    mapping = EnvMapping(observation={"observation.images.cam": "pixels", "observation.state": "pos"},
                         task="turn the knob", action_scale=[2.0])
    policy = ConstantPolicy([1.0], horizon=1)
    cfg = EvalConfig(env=EnvConfig("test/Knob-v0"), episodes=2, videos=0, mapping=mapping,
                     out=str(tmp_path), progress=False)
    rep = evaluate(policy, cfg, log=lambda m: None)
    s = rep.splits[0].summary
    assert s["success_rate"] == 1.0 and s["mean_steps_to_success"] == 1.0 and s["mean_return"] == 2.0
    seen = policy.seen[0]
    assert seen["observation.images.cam"] == (torch.Size([1, 3, 8, 8]), torch.uint8)
    assert seen["task"] == ["turn the knob"]
    with pytest.raises(ValueError, match="'missing'"):
        bad = EnvMapping(observation={"observation.state": "missing"})
        evaluate(policy, EvalConfig(env=EnvConfig("test/Knob-v0"), episodes=1, videos=0, mapping=bad,
                                    progress=False), save=False)
    with pytest.raises(ValueError, match="not LeRobot keys: map them with mapping.observation"):
        evaluate(policy, EvalConfig(env=EnvConfig("test/Knob-v0"), episodes=1, videos=0, progress=False), save=False)


class DialEnv(gymnasium.Env):
    """An outside env: reports ``info["success"]`` (not ``is_success``) on step 2 only and never
    ends on it (5 steps, then truncated); ``report=False``: no success key at all. Its constructor
    takes no ``image_size`` / ``render_size``."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, render_mode=None, report: bool = True):
        self.render_mode, self.report = render_mode, report
        self.observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), {}

    def step(self, action):
        self.t += 1
        info = {"success": self.t == 2} if self.report else {}
        return np.zeros(3, np.float32), 0.0, False, self.t >= 5, info


def test_outside_env_success_key_rules_and_the_warning(tmp_path):
    for env_id, report in (("test/Dial-v0", True), ("test/MuteDial-v0", False)):
        if env_id not in gymnasium.registry:
            gymnasium.register(env_id, entry_point=DialEnv, kwargs={"report": report})
    policy = ConstantPolicy([0.0], horizon=1)
    lines = []

    def run(env_id, **kw):
        cfg = EvalConfig(env=EnvConfig(env_id), episodes=2, videos=0, image_size=32, progress=False, **kw)
        return evaluate(policy, cfg, log=lines.append, save=False).splits[0]

    split = run("test/Dial-v0")  # image_size / render_size are not offered to this constructor
    assert split.summary["success_rate"] == 1.0 and split.episodes[0]["success_reported"]
    assert run("test/Dial-v0", success="final").summary["success_rate"] == 0.0
    assert not any("WARNING" in m for m in lines)
    mute = run("test/MuteDial-v0")
    assert mute.summary["success_rate"] == 0.0 and not mute.episodes[0]["success_reported"]
    assert any("WARNING" in m and "neither info['is_success'] nor info['success']" in m for m in lines)
    with pytest.raises(ValueError, match="success"):
        EvalConfig(success="sometimes")


def test_eval_offers_constructor_arguments_only_to_envs_that_take_them():
    from robopolicy.eval.envs import accepts_kwarg
    from robopolicy.eval.rollout import split_env_config

    if "test/Dial-v0" not in gymnasium.registry:
        gymnasium.register("test/Dial-v0", entry_point=DialEnv)
    state_policy = ConstantPolicy(np.zeros(6))
    state_policy.config = type("Cfg", (), {"cameras": [], "env_state_dim": 3, "frame_size": [32, 32]})()
    arm = split_env_config(EvalConfig(env=EnvConfig("robopolicy/ArmReach-v0")), None, state_policy)
    # ArmReach passes **kwargs on to the arm base class, which takes them
    assert arm.kwargs == {"use_cameras": False, "env_state": True, "image_size": 32, "render_size": 160}
    dial = split_env_config(EvalConfig(env=EnvConfig("test/Dial-v0"), image_size=64), None, state_policy)
    assert dial.kwargs == {}
    assert accepts_kwarg("robopolicy/PersonFollow-v0", "image_size") and not accepts_kwarg("Pusher-v5", "image_size")
    assert not accepts_kwarg("robopolicy/PointReach-v0", "image_size") and not accepts_kwarg("No-v9", "image_size")


def test_eval_config_rejects_unknown_split_and_keys():
    from robopolicy.config import load_config

    with pytest.raises(ConfigError, match="unknown split 'xx'"):
        load_config(EvalConfig, None, ["splits=[xx]"]).split_list()
    with pytest.raises(ConfigError, match="chunk.stepz"):
        load_config(EvalConfig, None, ["chunk.stepz=3"])
    cfg = load_config(EvalConfig, None, ["env.id=robopolicy/PersonFollow-v0"])
    assert cfg.split_list() == ["stt", "dt", "at"]
    assert load_config(EvalConfig, None, ["env.kwargs.split=dt"]).split_list() == ["dt"]


def eval_parser():
    import argparse

    from robopolicy.commands import eval as eval_cmd

    p = argparse.ArgumentParser(prog="robopolicy")
    eval_cmd.add_parser(p.add_subparsers(dest="command"))
    return p


def test_cli_without_or_with_a_missing_checkpoint(capsys):
    args = eval_parser().parse_args(["eval", "--env", "robopolicy/ArmReach-v0", "--episodes", "2"])
    with pytest.raises(ConfigError, match="--checkpoint"):
        args.func(args)
    args = eval_parser().parse_args(["eval", "--checkpoint", "/nonexistent/ckpt"])
    assert args.func(args) == 1
    assert "'/nonexistent/ckpt' is not a directory" in capsys.readouterr().err


def tiny_policy(**kw):
    from robopolicy.models.encoders import EncoderConfig
    from robopolicy.models.language import LanguageConfig
    from robopolicy.models.policy import Policy, PolicyConfig

    base = dict(head="chunk_l1", cameras=["front"], encoders=[EncoderConfig(name="resnet18", image_size=32)],
                context_strides=[0, 2], horizon=4, d_model=16, n_heads=2, n_layers=1, head_layers=1,
                action_shape=[6], state_dim=6, frame_size=[32, 32], language=LanguageConfig(enabled=False))
    base.update(kw)
    return Policy(PolicyConfig(**base))


def test_cli_evaluates_a_saved_policy_and_names_bad_checkpoints(tmp_path, capsys):
    ckpt = tiny_policy().save(tmp_path / "ckpt")
    out = tmp_path / "out"
    argv = ["eval", "--checkpoint", str(ckpt), "--env", "robopolicy/ArmReach-v0", "--episodes", "2", "--workers", "1",
            "--videos", "0", "--out", str(out), "--no-progress", "env.kwargs.max_steps=6"]
    args = eval_parser().parse_args(argv)
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "| ArmReach-v0 | 2 | 0.0 |" in printed
    data = json.loads((out / "eval.json").read_text())
    split = data["splits"][0]
    assert split["episodes"][0]["steps"] == 6 and data["config"]["image_size"] is None
    # the trained frame size (32) was used: chunks of 4 over 2 waves of 6 steps -> 2 predictions per wave
    assert split["policy_calls"] == 4

    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    args = eval_parser().parse_args(argv)
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "truncated or corrupt" in err


def test_cli_without_env_names_the_setting_when_the_checkpoint_records_no_task(tmp_path):
    ckpt = tiny_policy().save(tmp_path / "run" / "final")  # no train_config.yaml beside it
    args = eval_parser().parse_args(["eval", "--checkpoint", str(ckpt), "--episodes", "1", "--no-progress"])
    with pytest.raises(ConfigError, match="no env to evaluate .* give --env ID"):
        args.func(args)


def test_real_policy_context_is_fed_every_step_and_wrong_env_is_named(tmp_path):
    policy = tiny_policy()
    pushes = {"predict": 0, "observe": 0}
    predict, observe = policy.predict, policy.observe

    def counted(name, fn):
        def call(obs):
            pushes[name] += 1
            return fn(obs)
        return call

    policy.predict, policy.observe = counted("predict", predict), counted("observe", observe)
    env = EnvConfig("robopolicy/ArmReach-v0", {"max_steps": 7})
    evaluate(policy, arm_cfg(tmp_path, env=env, episodes=1), log=lambda m: None, save=False)
    # chunks of 4: predict at steps 0 and 4, observe on the other 5 steps (the context counts env steps)
    assert pushes == {"predict": 2, "observe": 5}
    # two envs, three episodes: the env that finishes first restarts alone (the policy resets that row)
    rep = evaluate(policy, arm_cfg(tmp_path, env=EnvConfig("robopolicy/ArmReach-v0", {"max_steps": 3}), episodes=3,
                                   workers=2), log=lambda m: None, save=False)
    assert sorted(e["seed"] for e in rep.splits[0].episodes) == [100_000, 100_001, 100_002]
    cfg = EvalConfig(env=EnvConfig("robopolicy/PersonFollow-v0", {"max_steps": 5}), splits=["stt"], episodes=1,
                     videos=0, progress=False, image_size=32)
    with pytest.raises(ValueError, match="cannot act in PersonFollow-v0\\[stt\\].*observation.state: expected 6 values, got 2"):
        evaluate(policy, cfg, log=lambda m: None, save=False)
