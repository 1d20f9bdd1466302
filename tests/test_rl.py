"""The shared RL pieces: the one PPO update's KL stop (both options), the actor-critic's
distribution parts, and residual checkpoints of the earlier tensor layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from robopolicy.config import ConfigError, build
from robopolicy.rl import ActorCritic, PPOSettings, ppo_update
from robopolicy.rl.ppo import Batch


class CountingAdam(torch.optim.Adam):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


def run_update(kl_stop: str, pg_coef: float = 1.0, target_kl: float = 1e-4) -> tuple[int, int, dict]:
    """One PPO update with a learning rate large enough that the KL target is crossed at once;
    the actor's and the critic's optimizer steps and the statistics."""
    torch.manual_seed(0)
    ac = ActorCritic(d_in=3, width=2, hidden=[16], log_std=torch.full((2,), -1.0))
    x = torch.randn(64, 3)
    with torch.no_grad():
        dist = ac.dist(x)
        r = dist.sample()
        batch = Batch(dist.log_prob(r), torch.randn(64), torch.randn(64))
    params = ac.trainable_parameters()
    opts = (CountingAdam(params["actor"], lr=0.05), CountingAdam(params["critic"], lr=1e-3))
    settings = PPOSettings(epochs=6, minibatches=2, target_kl=target_kl, kl_stop=kl_stop, pg_coef=pg_coef)
    stats = ppo_update(lambda idx: ac.dist(x[idx]).log_prob(r[idx]), lambda idx: ac.value(x[idx]), batch, opts,
                       params, settings)
    return opts[0].steps, opts[1].steps, stats


def test_the_kl_stop_ends_the_actors_epochs_or_the_whole_update():
    actor, critic, stats = run_update("actor")
    assert 0 < actor < 12 and critic == 12  # the critic keeps fitting the returns for every epoch
    assert stats["epochs"] < 6
    actor, critic, _ = run_update("update")
    assert 0 < actor < 12 and critic == actor  # RPD's: nothing steps after the stop
    # without the surrogate (pg_coef 0: a BC warm-up) no KL stop applies
    assert run_update("update", pg_coef=0.0)[:2] == (12, 12)
    assert run_update("actor", target_kl=1e9)[:2] == (12, 12)
    with pytest.raises(ValueError, match="kl_stop"):
        PPOSettings(epochs=1, kl_stop="epoch")


def test_each_distribution_part_has_its_own_log_prob():
    """A sample's log-probability is its Gaussian columns' (density, or the tail mass beyond a
    bound) plus its switch columns' categorical log-probability."""
    torch.manual_seed(0)
    ac = ActorCritic(d_in=4, width=3, hidden=[8], log_std=torch.zeros(3), switch=[2], switch_prob=0.1)
    dist = ac.dist(torch.randn(5, 4))
    r = dist.sample()
    assert set(r[:, 2].tolist()) <= {0.0, 1.0, 2.0}
    normal = dist.normal.log_prob(r)[:, :2].sum(-1)
    torch.testing.assert_close(dist.gaussian_log_prob(r), normal)
    prior = torch.log(torch.tensor([0.8, 0.1, 0.1]))  # untrained: the switch is at its prior
    torch.testing.assert_close(dist.switch_log_prob(r), prior[r[:, 2].long()])
    torch.testing.assert_close(dist.log_prob(r), normal + prior[r[:, 2].long()])
    # a sample beyond its bound scores the mass beyond it; an infinite bound is the density
    lo, hi = torch.full((5, 3), -torch.inf), torch.full((5, 3), torch.inf)
    torch.testing.assert_close(dist.gaussian_log_prob(r, lo, hi), normal)
    hi[:, 0] = r[:, 0] - 1.0
    lo[:, 0] = hi[:, 0] - 10.0
    tail = torch.special.log_ndtr((dist.mean[:, 0] - hi[:, 0]) / dist.stddev[:, 0])
    torch.testing.assert_close(dist.gaussian_log_prob(r, lo, hi), tail + dist.normal.log_prob(r)[:, 1])


def test_removed_options_are_refused_by_name():
    """Options removed after they measured no gain (docs/experiments/2026-12-07-removed-options.md)
    are unknown keys, named in the error, not silently ignored."""
    from robopolicy.refine.residual_ppo import ResidualPPOConfig

    for key, value in (("noise_hold", 4), ("state_noise", True), ("replay_failures", 0.5), ("replay_size", 8)):
        with pytest.raises(ConfigError, match=f"unknown key '{key}'"):
            build(ResidualPPOConfig, {key: value}, "recipe.yaml")


def test_a_residual_checkpoint_of_the_earlier_tensor_layout_still_loads(tmp_path):
    """Format 1 saved the actor-critic's tensors at the top level (``actor.*``, ``log_std``); it
    loads into the split policy with the same weights and actions."""
    import yaml
    from safetensors.torch import load_file, save_file

    from robopolicy.models import load_policy
    from robopolicy.refine.residual import RESIDUAL_CONFIG, RESIDUAL_WEIGHTS, ResidualConfig
    from robopolicy.refine.scratch import ScratchPolicy

    torch.manual_seed(0)
    low, high = -np.ones(3, np.float32), np.ones(3, np.float32)
    policy = ScratchPolicy(ResidualConfig(inputs=["state"], hidden=[8], log_std=-1.3), low, high, state_dim=4)
    with torch.no_grad():
        policy.actor[-1].bias.copy_(torch.tensor([0.2, -0.4, 0.6]))
        policy.norm.update(torch.randn(32, 4))
    path = policy.save(tmp_path / "new")
    state = load_file(str(path / RESIDUAL_WEIGHTS))
    assert all(k.startswith("ac.") or k.startswith("action_") for k in state)
    save_file({k.removeprefix("ac."): v for k, v in state.items()}, str(path / RESIDUAL_WEIGHTS))
    meta = yaml.safe_load((path / RESIDUAL_CONFIG).read_text())
    meta["format"] = 1
    (path / RESIDUAL_CONFIG).write_text(yaml.safe_dump(meta))
    old = load_policy(path)
    assert isinstance(old, ScratchPolicy)  # saved without a base: a policy learnt from scratch
    obs = {"observation.state": np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)}
    torch.testing.assert_close(old.predict(obs), policy.predict(obs))
    torch.testing.assert_close(old.log_std, policy.log_std)
    meta["format"] = 9
    (path / RESIDUAL_CONFIG).write_text(yaml.safe_dump(meta))
    with pytest.raises(Exception, match="format 9 is newer"):
        load_policy(path)


def test_a_refine_run_writes_its_summary_as_a_run_record(tmp_path):
    """``summary.json`` is the run record (commit, config digest, seeds, machine, wall time) with
    the method's own summary as its metrics, which a chain of stages reads back."""
    from robopolicy.envs import EnvConfig
    from robopolicy.refine import residual_ppo
    from robopolicy.refine.residual import ResidualConfig
    from robopolicy.refine.summary import read_refine_summary
    from robopolicy.utils.records import read_summary

    cfg = residual_ppo.ResidualPPOConfig(env=EnvConfig("robopolicy/PointReach-v0"), reward="dense",
                                         residual=ResidualConfig(inputs=["state"], hidden=[8]), total_env_steps=64,
                                         num_envs=1, num_steps=32, update_epochs=1, eval_every=64, eval_episodes=2,
                                         eval_envs=1, seed=3, out=str(tmp_path / "ppo"), progress=False)
    summary = residual_ppo.train(cfg, log=lambda s: None)
    record = read_summary(tmp_path / "ppo")
    assert record["kind"] == "refine" and record["seeds"] == [3] and record["episodes"] == 2
    assert record["config_digest"] and record["wall_time_s"] > 0 and record["machine"]
    assert record["metrics"]["env_steps"] == 64 and record["metrics"]["checkpoint"] == summary["checkpoint"]
    assert read_refine_summary(tmp_path / "ppo") == record["metrics"]
    assert read_refine_summary(tmp_path / "nowhere") is None
