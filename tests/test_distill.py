"""Teacher → camera student distillation (``robopolicy refine --method distill``) on a tiny config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from robopolicy.cli import main
from robopolicy.config import ConfigError, load_config
from robopolicy.envs import EnvConfig
from robopolicy.models.language import LanguageConfig
from robopolicy.models.loading import load_policy
from robopolicy.models.policy import Policy, PolicyConfig
from robopolicy.eval.episodes import EvalResult
from robopolicy.refine import dagger, distill
from robopolicy.refine.dagger import collect, make_batch
from sim_envs.wrappers import ENV_STATE

STUDENT = """
model:
  head: chunk_l1
  encoders:
    - {name: efficientnet_lite0, weights: imagenet, frozen: true, image_size: 32, stage: 3}
  grid: 2
  context_strides: [0]
  horizon: 4
  language: {enabled: false}
  d_model: 32
  n_heads: 2
  n_layers: 1
  head_layers: 1
"""
ROOT = Path(__file__).resolve().parents[1]
ENV = ["env.id=robopolicy/ArmPushCube-v0", "env.kwargs.image_size=32", "env.kwargs.max_steps=12"]
TINY = ["iterations=2", "steps_per_iteration=24", "num_envs=1", "finetune_steps=4", "batch_size=8",
        "eval_episodes=1", "eval_envs=1", "steps_per_chunk=2"]


@pytest.fixture
def student_config(tmp_path):
    path = tmp_path / "student.yaml"
    path.write_text(STUDENT)
    return path


def state_teacher(path, horizon: int = 6) -> Policy:
    """A small untrained state policy that reads the joint state and the privileged scene state."""
    cfg = PolicyConfig(head="chunk_l1", cameras=[], use_state=True, state_dim=6, env_state_dim=17, action_shape=[6],
                       horizon=horizon, language=LanguageConfig(enabled=False), d_model=16, n_heads=2, n_layers=1,
                       head_layers=1, context_strides=[0])
    torch.manual_seed(0)
    policy = Policy(cfg)
    policy.save(path)
    return policy


def test_distill_from_the_oracle_writes_a_camera_student_and_its_iterations(student_config, tmp_path):
    out = tmp_path / "run"
    rc = main(["refine", "--method", "distill", "--teacher", "oracle", "--student-config", str(student_config),
               "--out", str(out), "--no-progress", *ENV, *TINY])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())["metrics"]
    its = summary["iterations"]
    assert [r["iteration"] for r in its] == [0, 1]
    assert [r["beta"] for r in its] == [1.0, 0.25]
    assert [r["env_steps"] for r in its] == [24, 48] and summary["env_steps"] == 48
    assert all(0.0 <= r["success"] <= 1.0 and r["seconds"] > 0 for r in its)
    assert summary["teacher"] == "oracle" and summary["after"] == its[-1]["success"]
    assert summary["best"] == max(r["success"] for r in its) and (out / "best").is_dir()
    student = load_policy(out / "final")
    assert student.cameras == ["front", "wrist"] and student.config.env_state_dim == 0
    assert student.config.horizon == 4 and student.config.action_shape == [6]
    # the statistics came from the teacher's labels, not defaults
    assert not np.allclose(student.stats()["action"]["std"], 1.0)


def test_a_policy_teacher_labels_every_visited_state_with_its_own_chunk(student_config, tmp_path):
    teacher = state_teacher(tmp_path / "teacher")
    cfg = load_config(distill.DistillConfig, None, ENV + TINY + [f"teacher={tmp_path / 'teacher'}",
                                                                 f"student_config={student_config}"])
    labeller = distill.make_teacher(cfg)
    frames = collect(None, cfg, 1.0, np.random.default_rng(0), None, teacher=labeller, horizon=4)
    assert len(frames) == 24
    obs = {k: torch.from_numpy(np.stack([f["obs"][k] for f in frames[:5]])) for k in ("observation.state", ENV_STATE)}
    expected = teacher.predict(obs).numpy()[:, :4]
    np.testing.assert_allclose(np.stack([f["chunk"] for f in frames[:5]]), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.stack([f["label"] for f in frames[:5]]), expected[:, 0], rtol=1e-5, atol=1e-5)
    # the student reads no privileged state, though the rollout's observations hold it
    student = distill.build_student(distill.student_model(cfg), frames)
    assert student.config.env_state_dim == 0 and ENV_STATE not in make_batch(frames[:3], student)


def test_a_teacher_with_a_shorter_chunk_is_padded_with_its_last_action(tmp_path):
    state_teacher(tmp_path / "teacher", horizon=2)
    labeller = distill.PolicyTeacher(load_policy(tmp_path / "teacher"))
    obs = {"observation.state": np.zeros((3, 6), np.float32), ENV_STATE: np.ones((3, 17), np.float32)}
    chunks = labeller.chunks(obs, 5)
    assert chunks.shape == (3, 5, 6)
    np.testing.assert_array_equal(chunks[:, 2], chunks[:, 1])
    np.testing.assert_array_equal(chunks[:, 4], chunks[:, 1])


def test_cached_features_give_the_loss_of_the_images(student_config, tmp_path):
    cfg = load_config(distill.DistillConfig, None, ENV + TINY + [f"student_config={student_config}"])
    frames = collect(None, cfg, 1.0, np.random.default_rng(1), None, horizon=4)
    student = distill.build_student(distill.student_model(cfg), frames)
    picked = frames[:6]
    with torch.no_grad():
        from_images = student.losses(make_batch(picked, student), {"action": 1.0})["total"]
        distill.cache_features(student, frames)
        assert "observation.images.front" not in picked[0]["obs"] and picked[0]["features"].dtype == np.float16
        from_features = student.losses(make_batch(picked, student), {"action": 1.0})["total"]
    assert abs(float(from_images) - float(from_features)) < 1e-2 * max(1.0, abs(float(from_images)))


def test_config_errors_name_the_setting(student_config, tmp_path):
    with pytest.raises(ConfigError, match="give student_config"):
        load_config(distill.DistillConfig, None, ENV)
    with pytest.raises(ConfigError, match="distill.beta0"):
        load_config(distill.DistillConfig, None, ENV + [f"student_config={student_config}", "beta0=0.5"])
    cfg = load_config(distill.DistillConfig, None, ENV + [f"student_config={student_config}", "teacher=no/such/dir"])
    with pytest.raises(ConfigError, match="neither 'oracle' nor a checkpoint"):
        distill.make_teacher(cfg)
    cheating = tmp_path / "cheating.yaml"
    cheating.write_text(STUDENT + "data:\n  features: {env_state: observation.environment_state}\n")
    cfg = load_config(distill.DistillConfig, None, ENV + [f"student_config={cheating}"])
    with pytest.raises(ConfigError, match="the student reads no privileged scene state"):
        distill.student_model(cfg)


def test_evaluations_can_run_without_the_training_envs_randomisation(student_config, tmp_path, monkeypatch):
    cfg = load_config(distill.DistillConfig, None, ENV + TINY + [
        f"student_config={student_config}", "env.randomize.lighting=true", "eval_env.id=robopolicy/ArmPushCube-v0",
        "eval_env.kwargs.image_size=32", "iterations=1", f"out={tmp_path / 'run'}", "progress=false"])
    assert cfg.env.randomize == {"lighting": True}
    assert isinstance(cfg.eval_env, EnvConfig) and cfg.eval_env.randomize == {}
    evaluated = []

    def fake_eval(act, reset, env, *args, **kwargs):
        evaluated.append(env)
        return EvalResult(success=0.0, episodes=1, env_steps=1)

    monkeypatch.setattr(dagger, "evaluate_success", fake_eval)
    distill.train(cfg, log=lambda line: None)
    assert evaluated == [cfg.eval_env]


def test_the_wall_clock_budget_stops_before_an_iteration_that_would_pass_it(student_config, tmp_path):
    cfg = load_config(distill.DistillConfig, None, ENV + TINY + [f"student_config={student_config}", "iterations=3",
                                                                 "max_seconds=0.001", f"out={tmp_path / 'run'}",
                                                                 "progress=false"])
    lines = []
    summary = distill.train(cfg, log=lines.append)
    assert summary["iterations_run"] == 1 and len(summary["iterations"]) == 1
    assert any("stopping after 1 iterations" in line for line in lines)
    assert (tmp_path / "run" / "final").is_dir() and (tmp_path / "run" / "summary.json").is_file()


def test_distillation_learns_point_reach_from_its_oracle(tmp_path):
    """The task with a known answer: a state student taught by the oracle reaches nearly every goal."""
    cfg = load_config(distill.DistillConfig, None, [
        "env.id=robopolicy/PointReach-v0", "teacher=oracle", f"student_config={ROOT / 'configs/train/point/chunk.yaml'}",
        "chunk_labels=along", "iterations=1", "steps_per_iteration=400", "finetune_steps=200", "batch_size=32",
        "num_envs=1", "eval_episodes=20", "eval_envs=1", "steps_per_chunk=4", f"out={tmp_path / 'run'}",
        "progress=false"])
    summary = distill.train(cfg, log=lambda line: None)
    assert summary["iterations"][0]["success"] >= 0.9, summary["iterations"]
