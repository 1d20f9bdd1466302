"""State-based arm policies: the env's scene state, a camera-free policy trained on it, eval."""

from __future__ import annotations

import os
import random
from pathlib import Path

import gymnasium
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")

import sim_envs  # noqa: E402,F401  (registers the tasks)
from robopolicy.config import build  # noqa: E402
from robopolicy.data.collect import CollectConfig, collect  # noqa: E402
from robopolicy.data.errors import DatasetError  # noqa: E402
from robopolicy.envs import EnvConfig  # noqa: E402
from robopolicy.eval import EvalConfig, evaluate  # noqa: E402
from robopolicy.eval.rollout import observation_needs, split_env_config  # noqa: E402
from robopolicy.models.policy import ENV_STATE, Policy, PolicyError  # noqa: E402
from robopolicy.train.trainer import TrainConfig, build_dataset, train  # noqa: E402

PP = "robopolicy/ArmPickPlace-v0"


@pytest.mark.parametrize("task, dim", [("ArmReach", 17), ("ArmPushCube", 17), ("ArmPickPlace", 33)])
def test_env_state_observation_holds_the_goal_objects(task, dim):
    env = gymnasium.make(f"robopolicy/{task}-v0", use_cameras=False, env_state=True)
    obs, info = env.reset(seed=3)
    for _ in range(3):
        obs, _, _, _, info = env.step(env.action_space.sample())
    es = obs[ENV_STATE]
    assert es.dtype == np.float32 and es.shape == (dim,) == env.observation_space[ENV_STATE].shape
    np.testing.assert_allclose(es[0:3], info["ee_pos"], atol=1e-6)
    np.testing.assert_allclose(es[8:11], info["goal_pos"][3:], atol=1e-6)
    if "cube_pos" in info:
        np.testing.assert_allclose(es[3:6], info["goal_pos"][:3], atol=1e-6)
        np.testing.assert_allclose(es[11:14], es[3:6] - es[0:3], atol=1e-6)
        assert abs(np.hypot(es[6], es[7]) - 1.0) < 1e-5  # (cos 4θ, sin 4θ)
    else:
        np.testing.assert_allclose(es[11:14], es[8:11] - es[0:3], atol=1e-6)
    assert ENV_STATE not in gymnasium.make(f"robopolicy/{task}-v0", use_cameras=False).reset(seed=0)[0]
    with pytest.raises(ValueError, match="env_state"):
        gymnasium.make(f"robopolicy/{task}-v0", env_state="yes")


@pytest.fixture(scope="module")
def state_dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("state") / "pp"
    collect(CollectConfig(env=EnvConfig(PP, {"use_cameras": False, "env_state": True}), episodes=3, noise=0.1,
                          out=str(out), progress=False), log=lambda m: None)
    return out


def state_cfg(dataset: Path, out: Path) -> TrainConfig:
    cfg = {"name": "state", "out": str(out), "steps": 60, "batch_size": 16, "save_every": 0, "progress": False,
           "data": {"dataset": str(dataset), "features": {"cameras": [], "env_state": ENV_STATE,
                                                          "action": "oracle.action"}},
           "model": {"head": "chunk_l1", "context_strides": [0], "horizon": 4, "language": {"enabled": False},
                     "d_model": 32, "n_heads": 2, "n_layers": 1, "head_layers": 1},
           "optim": {"warmup_steps": 5}}
    return build(TrainConfig, cfg)


@pytest.fixture(scope="module")
def trained(state_dataset, tmp_path_factory):
    return train(state_cfg(state_dataset, tmp_path_factory.mktemp("run") / "run"), log=lambda m: None)


def test_a_camera_free_policy_trains_predicts_and_evaluates(trained, tmp_path):
    result = trained
    assert result.last_losses["action"] < result.first_losses["action"]
    policy = Policy.load(result.final)
    assert policy.vision is None and policy.cameras == []
    assert policy.config.env_state_dim == 33 and policy.config.state_dim == 6
    assert observation_needs(policy) == (False, True)

    env = gymnasium.make(PP, use_cameras=False, env_state=True)
    obs, _ = env.reset(seed=0)
    chunk = policy.predict(obs)
    assert chunk.shape == (1, 4, 6) and torch.isfinite(chunk).all()
    batch = {k: np.stack([v, v]) for k, v in obs.items() if k != "task"}
    assert policy.predict(batch).shape == (2, 4, 6)
    with pytest.raises(PolicyError, match="environment_state"):
        policy.predict({"observation.state": obs["observation.state"]})
    with pytest.raises(PolicyError, match="expected 33 values"):
        policy.predict({**obs, ENV_STATE: obs[ENV_STATE][:5]})

    # eval makes the env without cameras and with the scene state, from the checkpoint alone
    cfg = EvalConfig(env=EnvConfig(PP, {"max_steps": 10}), episodes=2, workers=1, videos=0,
                     out=str(tmp_path / "eval"), progress=False)
    kwargs = split_env_config(cfg, None, policy).kwargs
    assert kwargs["use_cameras"] is False and kwargs["env_state"] is True
    report = evaluate(policy, cfg, log=lambda m: None, save=False)
    assert len(report.splits[0].episodes) == 2 and report.splits[0].env_steps > 0


def test_env_state_feature_the_dataset_lacks_is_named(state_dataset, tmp_path):
    cfg = state_cfg(state_dataset, tmp_path / "bad")
    cfg.data.features.env_state = "observation.scene"
    with pytest.raises(DatasetError, match="data.features.env_state asks for the feature 'observation.scene'") as err:
        build_dataset(cfg, progress=False)
    assert "label" not in str(err.value).split("(features:")[0]  # a scene state is not called a label


def test_dagger_relabels_a_state_policy_with_its_scene_state(trained, state_dataset):
    from robopolicy.refine import dagger

    policy = Policy.load(trained.final)
    env = gymnasium.make(PP, use_cameras=False, env_state=True)
    obs, _ = env.reset(seed=1)
    frames = [{"obs": obs, "future": np.zeros((2, 6), np.float32), "label": np.zeros(6, np.float32)}] * 3
    batch = dagger.make_batch(frames, policy)
    assert batch[ENV_STATE].shape == (3, 33) and batch["action"].shape == (3, 4, 6)
    assert torch.isfinite(policy.losses(batch, {"action": 1.0})["total"])
    cfg = dagger.DAggerConfig(original=str(state_dataset), original_action="oracle.action", original_episodes=[0, 1])
    original = dagger.original_dataset(cfg, policy)
    assert len(original.episodes) == 2
    mixed = dagger._mix(batch, original, 2, random.Random(0))
    assert mixed[ENV_STATE].shape == (5, 33)
    assert torch.isfinite(policy.losses(mixed, {"action": 1.0})["total"])


def test_goal_rel_is_the_goal_from_the_tool_centre_point():
    env = gymnasium.make(PP, use_cameras=False)
    _, info = env.reset(seed=5)
    for _ in range(4):
        _, _, _, _, info = env.step(env.action_space.sample())
    np.testing.assert_allclose(info["goal_rel"], info["goal_pos"] - np.tile(info["ee_pos"], 2), atol=1e-6)


def _tiny_locator(path: Path, label: str) -> Path:
    """An untrained camera locator checkpoint (front + wrist, MLP locate head) estimating ``label``."""
    from robopolicy.models.encoders import EncoderConfig
    from robopolicy.models.language import LanguageConfig
    from robopolicy.models.policy import PolicyConfig

    def entry(n):
        z, o = np.zeros(n, np.float32), np.ones(n, np.float32)
        return {"mean": z, "std": o, "min": -o, "max": o, "q01": -o, "q99": o}

    cfg = PolicyConfig(head="chunk_l1", cameras=["front", "wrist"], context_strides=[0], horizon=4,
                       encoders=[EncoderConfig(name="test_resnet", frozen=True, image_size=64, pool="keypoints",
                                               keypoints=4, keypoint_features=False)],
                       aux_heads=["locate"], locate_head="mlp", locate_label=label, language=LanguageConfig(enabled=False),
                       d_model=16, n_heads=2, n_layers=1, head_layers=1, action_shape=[6], state_dim=6, frame_size=[96, 96])
    return Policy(cfg, {"action": entry(6), "observation.state": entry(6), label: entry(6)}).save(path)


@pytest.fixture(scope="module")
def modular(state_dataset, tmp_path_factory):
    """``train`` with ``locator``: an actor on ``label.goal_rel`` composed with a tiny locator."""
    tmp = tmp_path_factory.mktemp("modular")
    cfg = state_cfg(state_dataset, tmp / "actor")
    cfg.data.features.env_state = "label.goal_rel"
    cfg.locator = str(_tiny_locator(tmp / "locator", "label.goal_rel"))
    return train(cfg, log=lambda m: None)


def test_a_locator_turns_the_trained_actor_into_a_policy_that_runs_from_cameras(modular, state_dataset, tmp_path):
    """train with `locator`: the final checkpoint is a ModularPolicy that evaluation runs on an env
    with cameras and without the privileged scene state; a locator of another label is refused."""
    from robopolicy.models.modular import ModularPolicy
    from robopolicy.models.loading import load_policy
    from robopolicy.train.trainer import TrainError

    result = modular
    policy = load_policy(result.final)
    assert isinstance(policy, ModularPolicy) and policy.actor.config.env_state_dim == 6
    assert observation_needs(policy) == (True, False)
    ecfg = EvalConfig(env=EnvConfig(PP, {"max_steps": 6}), episodes=1, workers=1, videos=0,
                      out=str(tmp_path / "eval"), progress=False)
    kwargs = split_env_config(ecfg, None, policy).kwargs
    assert "use_cameras" not in kwargs and "env_state" not in kwargs and kwargs["image_size"] == 96
    report = evaluate(policy, ecfg, log=lambda m: None, save=False)
    assert report.splits[0].env_steps > 0
    from robopolicy.deploy.worker import load_checkpoint  # the deployment worker takes it too

    worker = load_checkpoint(result.final)  # its control rate from the run's dataset
    obs, _ = gymnasium.make(PP, image_size=96).reset(seed=1)
    assert worker.kind == "action" and worker.dt == pytest.approx(0.05)
    assert worker.predict({k: (v if k == "task" else v[None]) for k, v in obs.items()}, 0.0).shape == (4, 6)

    cfg = state_cfg(state_dataset, tmp_path / "other")
    cfg.data.features.env_state = "label.goal_rel"
    cfg.locator = str(_tiny_locator(tmp_path / "locator_pos", "label.goal_pos"))
    with pytest.raises(TrainError, match="estimates 'label.goal_pos'"):
        train(cfg, log=lambda m: None)


def test_dagger_relabels_a_modular_policys_locator_with_the_envs_scene_label(modular, trained, tmp_path):
    """DAgger on a perceive-then-act base trains the locator's locate head on the env's scene label
    at the visited states; the actor stays as it was; the result is a modular checkpoint."""
    from robopolicy.models.modular import ModularPolicy
    from robopolicy.refine import dagger

    base = ModularPolicy.load(modular.final)
    cfg = dagger.DAggerConfig(env=EnvConfig(PP, {"max_steps": 8}), base=str(modular.final), iterations=2,
                              steps_per_iteration=10, num_envs=1, filter=[], max_states=12, finetune_steps=4, batch_size=4,
                              lr=1e-2, eval_episodes=1, eval_envs=1, out=str(tmp_path / "dagger"), progress=False)
    frames = dagger.collect(base, cfg, 0.5, np.random.default_rng(0), None, "label.goal_rel")
    scene = np.stack([f["scene"] for f in frames])
    assert scene.shape == (len(frames), 6) and len(frames) >= 10
    assert np.isfinite(scene).all() and np.ptp(scene[:, :3], axis=0).max() > 1e-3  # the arm moved: labels differ
    batch = dagger.make_batch(frames[:3], base.locator, "label.goal_rel")
    assert batch["label.goal_rel"].shape == (3, 6) and "action" not in batch

    summary = dagger.train(cfg, log=lambda m: None)
    assert summary["learner"] == "locator" and summary["kept_states"] >= 20
    assert summary["aggregate_states"] == 12  # max_states: only the newest states stay in the aggregate
    assert (summary["best"] is None) == (summary["best_checkpoint"] is None)  # saved only when it beat the base
    if summary["best_checkpoint"]:
        assert ModularPolicy.load(summary["best_checkpoint"]) is not None
    after = ModularPolicy.load(summary["checkpoint"])
    head = lambda p: torch.cat([q.flatten() for q in p.locator.aux["locate"].parameters()])  # noqa: E731
    actor = lambda p: torch.cat([q.flatten() for q in p.actor.parameters()])  # noqa: E731
    assert not torch.equal(head(after), head(base))
    assert torch.equal(actor(after), actor(base))

    with pytest.raises(PolicyError, match="modular"):
        dagger.resolve_learner(Policy.load(trained.final), "locator")
    with pytest.raises(PolicyError, match="learner: locator"):
        dagger.resolve_learner(base, "policy")
    with pytest.raises(ValueError, match="dagger.learner"):
        dagger.DAggerConfig(learner="actor")
    with pytest.raises(ValueError, match="dagger.max_states"):
        dagger.DAggerConfig(max_states=-1)
    with pytest.raises(PolicyError, match="cannot relabel a Linear"):
        dagger.resolve_learner(torch.nn.Linear(2, 2), "auto")
    with pytest.raises(PolicyError, match="no 'nope' in its info"):
        dagger.collect(base, cfg, 0.0, np.random.default_rng(0), None, "label.nope")


def test_dagger_chunk_labels_from_the_oracles_own_rollout(trained):
    """``chunk_labels: oracle``: each visited state's target is the oracle's own next H actions
    from it (its first the state's label), not the labels of the states the policy went on to."""
    from robopolicy.envs import EnvConfig
    from robopolicy.refine import dagger

    policy = Policy.load(trained.final)
    h = policy.config.horizon
    runs = {}
    for mode in ("along", "oracle"):
        cfg = dagger.DAggerConfig(env=EnvConfig(PP, {"use_cameras": False, "env_state": True}), num_envs=1,
                                  steps_per_iteration=40, chunk_labels=mode, filter=[])
        runs[mode] = dagger.collect(policy, cfg, 0.0, np.random.default_rng(0), None)
    along, oracle = runs["along"], runs["oracle"]
    assert len(along) == len(oracle) == 40
    for a, o in zip(along, oracle):
        np.testing.assert_array_equal(a["obs"]["observation.state"], o["obs"]["observation.state"])  # same rollout
        assert o["future"].shape == (h, 6)
        np.testing.assert_array_equal(o["future"][0], o["label"])
    # along the policy's path the later labels differ from the oracle's own plan
    assert any(not np.allclose(a["future"][:h][-1], o["future"][-1]) for a, o in zip(along[:-h], oracle[:-h]))
    with pytest.raises(ValueError, match="chunk_labels"):
        dagger.DAggerConfig(chunk_labels="nope")


def test_dagger_run_counts_its_counterfactual_steps(trained, tmp_path):
    from robopolicy.envs import EnvConfig
    from robopolicy.refine import dagger
    from robopolicy.refine.summary import read_refine_summary
    from robopolicy.utils.records import read_summary

    counts = {}
    for mode in ("along", "oracle"):
        cfg = dagger.DAggerConfig(env=EnvConfig(PP, {"use_cameras": False, "env_state": True, "max_steps": 12}),
                                  base=str(trained.final), iterations=1, steps_per_iteration=12, num_envs=1,
                                  filter=[], chunk_labels=mode, finetune_steps=2, batch_size=4, eval_episodes=1,
                                  eval_envs=1, out=str(tmp_path / mode), progress=False)
        summary = dagger.train(cfg, log=lambda m: None)
        record = read_summary(tmp_path / mode)  # the run record, the method's summary its metrics
        assert record["kind"] == "refine" and record["seeds"] == [cfg.seed] and record["episodes"] == 1
        assert read_refine_summary(tmp_path / mode)["counterfactual_steps"] == summary["counterfactual_steps"]
        counts[mode] = summary["counterfactual_steps"]
        assert summary["env_steps"] == 12
        assert summary["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
        assert summary["seconds_by_phase"]["rollout"] > 0 and summary["seconds_by_phase"]["finetune"] > 0
        # fine-tuned on the device, saved and rolled out from the CPU
        assert Policy.load(summary["checkpoint"]).device.type == "cpu"
    h = Policy.load(trained.final).config.horizon
    assert counts["along"] == 0
    assert 0 < counts["oracle"] <= 12 * (h - 1)  # chunks stop at the 12-step episode's end


def test_dagger_refuses_a_device_that_is_not_there_before_rolling_out(trained, tmp_path, monkeypatch):
    from robopolicy.envs import EnvConfig
    from robopolicy.refine import dagger
    from robopolicy.train.trainer import TrainError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dagger, "collect", lambda *a, **k: pytest.fail("rolled out before checking the device"))
    cfg = dagger.DAggerConfig(env=EnvConfig(PP, {"use_cameras": False, "env_state": True, "max_steps": 12}),
                              base=str(trained.final), iterations=1, steps_per_iteration=12, num_envs=1, filter=[],
                              device="cuda", eval_episodes=1, eval_envs=1, out=str(tmp_path / "run"),
                              progress=False)
    with pytest.raises(TrainError, match="CUDA is not available"):
        dagger.train(cfg, log=lambda m: None)
    assert not (tmp_path / "run").exists()
