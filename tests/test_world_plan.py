"""MPPI planning in a world model: it finds better chunks than the nominal, stops safely on NaN, refuses
sizes that do not fit, and plugs into eval as a checkpoint of type ``planned``."""

from __future__ import annotations

import json

import pytest
import torch

from robopolicy.world.model import WorldModel, WorldModelConfig, WorldModelError
from robopolicy.world.plan import MPPIConfig, MPPIPlanner, PlannedPolicy, check_base


class PointModel(torch.nn.Module):
    """A known world model: the latent is the point, ``next = z + 0.1 a``, the reward the progress
    toward a fixed goal; no success, no value."""

    obs_dim, act_dim = 2, 2

    def __init__(self, goal=(0.8, 0.2), reward_nan=False):
        super().__init__()
        self.cfg = WorldModelConfig(gamma=1.0)
        self.goal, self.reward_nan = torch.tensor(goal), reward_nan
        self.reward_scale = torch.tensor(1.0)

    def encode(self, obs):
        return obs

    def next(self, z, a):
        return z + 0.1 * a

    def reward(self, z, a):
        r = (z - self.goal).norm(dim=-1) - (self.next(z, a) - self.goal).norm(dim=-1)
        return r * float("nan") if self.reward_nan else r

    def success(self, z):
        return torch.full(z.shape[:-1], -30.0)

    def pi(self, z, deterministic=False):
        return torch.zeros(*z.shape[:-1], 2), torch.zeros(z.shape[:-1])

    def Q(self, z, a, return_type="min", target=False):
        return torch.zeros(z.shape[:-1])


def test_mppi_moves_the_chunk_toward_higher_predicted_return():
    model = PointModel()
    planner = MPPIPlanner(model, MPPIConfig(horizon=4, samples=128, elites=16, iterations=4, std=0.5))
    start = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
    nominal = torch.zeros(2, 4, 2)
    plan = planner.plan(start, nominal)
    assert plan.shape == (2, 4, 2) and plan.abs().max() <= 1
    assert (planner.score(start, plan) > planner.score(start, nominal) + 0.1).all()
    to_goal = model.goal - start
    cos = torch.nn.functional.cosine_similarity(plan.mean(1), to_goal, dim=-1)
    assert (cos > 0.8).all(), cos


def test_nan_scores_return_the_nominal_chunk_with_a_warning(caplog):
    planner = MPPIPlanner(PointModel(reward_nan=True), MPPIConfig(horizon=3, samples=16, elites=4))
    nominal = torch.full((1, 3, 2), 0.25)
    with caplog.at_level("WARNING"):
        plan = planner.plan(torch.tensor([[0.5, 0.5]]), nominal)
    assert torch.equal(plan, nominal) and "NaN" in caplog.text


def test_sizes_that_do_not_fit_the_world_model_are_refused():
    torch.manual_seed(0)
    planner = MPPIPlanner(WorldModel(4, 2, WorldModelConfig(latent_dim=16, hidden=[32], num_q=2)))
    assert planner.plan(torch.rand(1, 4)).shape == (1, 8, 2)  # no base: the policy prior is the nominal
    with pytest.raises(WorldModelError, match=r"states of shape \(1, 6\).*\(B, 4\)"):
        planner.plan(torch.rand(1, 6))
    with pytest.raises(WorldModelError, match="3 action entries, the world model takes 2"):
        planner.plan(torch.rand(1, 4), torch.zeros(1, 8, 3))

    class Base:
        config = type("Config", (), {"action_shape": [6], "state_dim": 4})()

    with pytest.raises(WorldModelError, match=r"actions have shape \[6\]"):
        check_base(Base(), planner.model)


def test_reset_of_some_rows_reaches_the_base_for_those_rows_only():
    class Base:
        def __init__(self):
            self.resets = []

        def reset(self, rows=None):
            self.resets.append(rows)

    base = Base()
    policy = PlannedPolicy(PointModel(), MPPIConfig(horizon=2, samples=4, elites=2), base)
    policy.reset([1])
    policy.reset()
    assert base.resets == [[1], None]


def test_planned_checkpoint_evaluates_through_the_cli(tmp_path):
    from robopolicy.cli import main
    from robopolicy.models.loading import load_policy

    WorldModel(4, 2, WorldModelConfig(latent_dim=16, hidden=[32], num_q=2)).save(tmp_path / "world")
    assert main(["world", "plan", "--world", str(tmp_path / "world"), "--out", str(tmp_path / "plan"),
                 "mppi.samples=16", "mppi.elites=4", "mppi.iterations=2"]) == 0
    policy = load_policy(tmp_path / "plan")
    assert isinstance(policy, PlannedPolicy) and policy.planner.cfg.samples == 16
    assert policy.predict({"observation.state": torch.rand(3, 4)}).shape == (3, 8, 2)
    assert main(["eval", "--checkpoint", str(tmp_path / "plan"), "--env", "robopolicy/PointReach-v0", "--episodes", "2",
                 "--videos", "0", "--out", str(tmp_path / "eval"), "--no-progress", "threads=1"]) == 0
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())


def test_planned_checkpoint_without_a_world_model_is_refused(tmp_path):
    (tmp_path / "config.yaml").write_text("type: planned\n")
    with pytest.raises(WorldModelError, match="needs type: planned and world: DIR"):
        PlannedPolicy.load(tmp_path)


def test_the_policy_worker_serves_a_planned_checkpoint(tmp_path):
    from pathlib import Path

    import numpy as np

    from robopolicy.deploy.worker import load_checkpoint

    WorldModel(4, 2, WorldModelConfig(latent_dim=16, hidden=[32], num_q=2)).save(tmp_path / "world")
    PlannedPolicy.write(tmp_path / "plan", tmp_path / "world", None, MPPIConfig(samples=8, elites=2, iterations=1))
    worker_policy = load_checkpoint(Path(tmp_path / "plan"), dt=0.1)
    chunk = worker_policy.predict({"observation.state": np.full(4, 0.5, np.float32), "task": ""}, 0.0)
    assert chunk.shape == (8, 2) and np.isfinite(chunk).all()


def test_plan_with_a_base_of_another_task_leaves_no_checkpoint(tmp_path, capsys):
    from robopolicy.cli import main
    from robopolicy.models.language import LanguageConfig
    from robopolicy.models.policy import Policy, PolicyConfig

    WorldModel(4, 2, WorldModelConfig(latent_dim=16, hidden=[32], num_q=2)).save(tmp_path / "world")
    Policy(PolicyConfig(head="chunk_l1", cameras=[], use_state=True, state_dim=4, action_shape=[6], horizon=4,
                        language=LanguageConfig(enabled=False), d_model=16, n_heads=2, n_layers=1, head_layers=1,
                        context_strides=[0])).save(tmp_path / "base")
    (tmp_path / "base" / "train_config.yaml").write_text("seed: 0\n")
    code = main(["world", "plan", "--world", str(tmp_path / "world"), "--checkpoint", str(tmp_path / "base"),
                 "--out", str(tmp_path / "plan")])
    assert code == 1 and "actions have shape [6]" in capsys.readouterr().out
    assert list((tmp_path / "plan").iterdir()) == []


def test_plan_refuses_an_override_outside_mppi(tmp_path, capsys):
    from robopolicy.cli import main

    WorldModel(4, 2, WorldModelConfig(latent_dim=16, hidden=[32], num_q=2)).save(tmp_path / "world")
    code = main(["world", "plan", "--world", str(tmp_path / "world"), "--out", str(tmp_path / "plan"), "samples=16"])
    assert code == 2 and "'samples' is not a planner setting" in capsys.readouterr().err
    assert not (tmp_path / "plan").exists()
