"""HG-DAgger with SimOperator: only the interventions are labelled (with the operator's actions),
and the whole deploy → intervene → retrain loop runs unattended on PointReach."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from robopolicy.envs import EnvConfig
from robopolicy.models.policy import LanguageConfig, Policy, PolicyConfig
from robopolicy.refine import dagger
from robopolicy.teleop import hg_dagger

ENV = EnvConfig("robopolicy/PointReach-v0", {"max_steps": 20})


def tiny_point_policy(seed: int = 0) -> Policy:
    torch.manual_seed(seed)
    cfg = PolicyConfig(head="chunk_l1", cameras=[], context_strides=[0], horizon=4, language=LanguageConfig(enabled=False),
                       d_model=16, n_heads=2, n_layers=1, head_layers=1, action_shape=[2], state_dim=4)
    stats = {"action": {k: np.full(2, v, np.float32) for k, v in
                        (("mean", 0), ("std", 0.5), ("min", -1), ("max", 1), ("q01", -1), ("q99", 1))},
             "observation.state": {k: np.full(4, v, np.float32) for k, v in
                                   (("mean", 0.5), ("std", 0.3), ("min", 0), ("max", 1), ("q01", 0), ("q99", 1))}}
    return Policy(cfg, stats).eval()


def test_only_interventions_are_labelled_with_the_operators_actions(monkeypatch):
    def away(policy, steps, waypoints):  # a policy heading away from the goal (the left edge), every env
        return (lambda obs: np.tile([-1.0, 0.0], (len(obs["observation.state"]), 1)).astype(np.float32)), (lambda rows: None)

    monkeypatch.setattr(dagger, "policy_actor", away)
    cfg = hg_dagger.HGDAggerConfig(env=ENV, num_envs=2, steps_per_iteration=80, progress=False,
                                   operator={"noise": 0.0, "lapse_rate": 0.0, "max_drive_s": 100.0})
    frames, counts = hg_dagger.collect(None, cfg, np.random.default_rng(0))
    assert counts["env_steps"] == 80 and counts["takeovers"] >= 2
    assert 0 < len(frames) < counts["env_steps"]  # the operator watched first, then drove
    assert all(f["intervention"] for f in frames)
    f = frames[0]
    s = f["obs"]["observation.state"]
    np.testing.assert_allclose(f["label"], np.clip((s[2:] - s[:2]) / 0.1, -1, 1), atol=1e-6)  # the oracle's move, noise 0
    assert f["future"].shape[1] == 2 and f["episode"][f["index"]] is f
    with pytest.raises(ValueError, match="hg-dagger.label"):
        hg_dagger.HGDAggerConfig(label="human")


def test_hg_dagger_runs_unattended_and_reports_labels_beside_the_gain(tmp_path):
    cfg = hg_dagger.HGDAggerConfig(env=ENV, num_envs=2, iterations=1, steps_per_iteration=60, finetune_steps=5,
                                   batch_size=8, lr=1e-3, eval_episodes=2, eval_envs=1, device="cpu", progress=False,
                                   out=str(tmp_path / "hg"))
    lines: list[str] = []
    s = hg_dagger.train(cfg, policy=tiny_point_policy(), log=lines.append)
    assert s["env_steps"] == 60 and 0 < s["labels"] <= 60 and s["label_fraction"] == s["labels"] / 60
    assert s["gain_pts"] == pytest.approx(100 * (s["after"] - s["before"]))
    assert (tmp_path / "hg" / "final").is_dir() and (tmp_path / "hg" / "summary.json").is_file()
    assert "labels" in lines[-1] and "gain" in lines[-1]
