"""Refinement: residual starts at the base, PPO learns, DAgger filter, RPD pulls toward the teacher,
clear errors, checkpoint round trip (and ``robopolicy.eval`` runs the combined checkpoint)."""

from __future__ import annotations

import csv
import dataclasses
import random

import numpy as np
import pytest
import torch

from robopolicy.envs import EnvConfig
from robopolicy.eval.episodes import evaluate_success, tracking_metrics
from robopolicy.models import load_policy
from robopolicy.models.encoders import EncoderConfig
from robopolicy.models.language import LanguageConfig
from robopolicy.models.policy import Policy, PolicyConfig, PolicyError
from robopolicy.refine import dagger
from robopolicy.refine.common import Curve
from robopolicy.refine.residual import BASE_DIR, ResidualConfig, ResidualPolicy
from robopolicy.refine.scratch import ScratchPolicy
from robopolicy.rl import RewardScaler, gae, ppo_loss

LOW, HIGH = -np.full(6, 20.0, np.float32), np.full(6, 20.0, np.float32)


def tiny_base(action_dim: int = 6, seed: int = 0) -> Policy:
    torch.manual_seed(seed)
    cfg = PolicyConfig(head="chunk_l1", cameras=["front"], encoders=[EncoderConfig(name="test_resnet", image_size=32)],
                       grid=2, context_strides=[0], horizon=6, language=LanguageConfig(enabled=False), d_model=32,
                       n_heads=2, n_layers=1, head_layers=1, action_shape=[action_dim], state_dim=6, frame_size=[32, 32])
    shape = (action_dim,)
    stats = {"action": {"mean": np.full(shape, 0.5, np.float32), "std": np.full(shape, 0.3, np.float32),
                        "min": np.full(shape, -1, np.float32), "max": np.full(shape, 2, np.float32),
                        "q01": np.zeros(shape, np.float32), "q99": np.ones(shape, np.float32)},
             "observation.state": {k: np.full(6, v, np.float32) for k, v in
                                   (("mean", 0), ("std", 1), ("min", -1), ("max", 1), ("q01", -1), ("q99", 1))}}
    return Policy(cfg, stats).eval()


def obs_batch(b: int = 2, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"observation.images.front": rng.integers(0, 255, (b, 32, 32, 3), dtype=np.uint8),
            "observation.state": rng.normal(size=(b, 6)).astype(np.float32), "task": ["reach"] * b}


def test_residual_starts_exactly_at_the_base():
    base = tiny_base()
    obs = obs_batch()
    chunk = base.predict(obs).numpy()  # (B, H, A)
    base.reset()
    policy = ResidualPolicy(ResidualConfig(execute_steps=4), LOW, HIGH, base=base)
    policy.reset()
    policy.residual_input(obs, peek=True)  # a bootstrap peek leaves the queued actions in place
    for k in range(4):  # the queue executes the first 4 actions of the same chunk
        np.testing.assert_allclose(policy.predict(obs)[:, 0].numpy(), chunk[:, k], atol=1e-5)
    # a trained (non-zero) residual moves the action by at most scale * |r| in normalized units
    torch.nn.init.normal_(policy.actor[-1].weight)
    policy.reset()
    moved = policy.predict(obs)[:, 0].numpy()
    assert not np.allclose(moved, chunk[:, 0])


def test_per_dimension_residual_scale():
    base = tiny_base()
    policy = ResidualPolicy(ResidualConfig(scale_per_dim=[0.1, 0.1, 0.1, 0.1, 0.1, 1.0]), LOW, HIGH, base=base)
    base_norm, r = torch.zeros(1, 6), torch.full((1, 6), 0.5)
    moved = policy.env_action(base_norm, r).numpy()[0] / HIGH  # back to normalized units
    np.testing.assert_allclose(moved, [0.05] * 5 + [0.5], atol=1e-6)
    with pytest.raises(PolicyError, match="scale_per_dim has 2 values"):
        ResidualPolicy(ResidualConfig(scale_per_dim=[0.1, 1.0]), LOW, HIGH, base=tiny_base())
    with pytest.raises(ValueError, match="finite"):
        ResidualConfig(scale_per_dim=[float("nan")] * 6)


def test_per_dimension_log_std():
    policy = ResidualPolicy(ResidualConfig(log_std_per_dim=[-2.0] * 5 + [0.0]), LOW, HIGH, base=tiny_base())
    std = policy.dist(torch.zeros(3, policy.norm.mean.shape[0])).stddev
    np.testing.assert_allclose(std.numpy(), np.tile(np.exp([-2.0] * 5 + [0.0]), (3, 1)), rtol=1e-6)
    with pytest.raises(PolicyError, match="log_std_per_dim has 2 values"):
        ResidualPolicy(ResidualConfig(log_std_per_dim=[-2.0, 0.0]), LOW, HIGH, base=tiny_base())
    with pytest.raises(ValueError, match="finite"):
        ResidualConfig(log_std_per_dim=[float("inf")] * 6)


def test_the_time_input_counts_each_rows_steps_since_its_reset(tmp_path):
    with pytest.raises(ValueError, match="time_horizon"):
        ResidualConfig(inputs=["state", "time"])
    base = tiny_base()
    policy = ResidualPolicy(ResidualConfig(inputs=["state", "base_action", "time"], time_horizon=10, execute_steps=4),
                            LOW, HIGH, base=base)
    obs = obs_batch(b=3)
    policy.reset()
    seen = []
    for _ in range(3):
        x, _ = policy.residual_input(obs)
        seen.append(x[:, -1].numpy().copy())
    np.testing.assert_allclose(seen, [[0.0] * 3, [0.1] * 3, [0.2] * 3], atol=1e-6)
    assert policy.residual_input(obs, peek=True)[0][0, -1].item() == pytest.approx(0.3)  # a peek does not count
    policy.reset([1])  # row 1's episode ended: only its clock restarts
    np.testing.assert_allclose(policy.residual_input(obs)[0][:, -1].numpy(), [0.3, 0.0, 0.3], atol=1e-6)
    # an untrained residual still reproduces the base exactly, the clock is saved as an input
    policy.save(tmp_path / "res")
    again = load_policy(tmp_path / "res")
    assert again.input_dims["time"] == 1 and again.config.time_horizon == 10
    policy.reset(), base.reset()
    chunk = base.predict(obs).numpy()
    np.testing.assert_allclose(again.predict(obs)[:, 0].numpy(), chunk[:, 0], atol=1e-5)


def ppo_bandit(policy: ResidualPolicy, x: torch.Tensor, reward_of, iterations: int, epochs: int = 5) -> tuple[float, float]:
    """PPO on a contextual bandit: each iteration samples residuals for the inputs ``x``, pays
    ``reward_of(r)`` and runs ``epochs`` clipped updates; returns the surrogate loss before and
    after the first iteration's updates."""
    opt = torch.optim.Adam(policy.actor.parameters(), lr=1e-2)

    def surrogate(r, logp, adv):
        return ppo_loss(policy.log_prob(policy.dist(x), r, clipped=False), logp, adv, 0.2)[0]
    first = None
    for _ in range(iterations):
        with torch.no_grad():
            dist = policy.dist(x)
            r = dist.sample()
            logp = policy.log_prob(dist, r, clipped=False)
            reward = reward_of(r).float()
            adv = (reward - reward.mean()) / (reward.std() + 1e-8)
            before = surrogate(r, logp, adv).item()
        for _ in range(epochs):
            loss = surrogate(r, logp, adv)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if first is None:
            with torch.no_grad():
                first = (before, surrogate(r, logp, adv).item())
    return first


def test_ppo_update_lowers_loss_and_learns_a_bandit():
    torch.manual_seed(0)
    policy = ScratchPolicy(ResidualConfig(inputs=["state"], hidden=[32], log_std=-0.5), -np.ones(1), np.ones(1),
                            state_dim=2)
    x = torch.randn(256, 2)
    # contextual bandit: reward 1 when the action's sign matches the first input's sign
    before, after = ppo_bandit(policy, x, lambda r: torch.sign(r[:, 0]) == torch.sign(x[:, 0]), 30)
    assert after < before - 0.05  # the first update lowers the surrogate loss on its batch
    with torch.no_grad():
        mean = policy.dist(x).mean[:, 0]
    assert (torch.sign(mean) == torch.sign(x[:, 0])).float().mean() > 0.9


def test_a_switch_dimension_keeps_the_base_or_forces_an_end_and_learns_which():
    """``switch_dims``: the gripper-like dimension is a categorical (keep the base's command, the
    box's low end, its high end) that starts at the base and that PPO can move."""
    base = tiny_base()
    policy = ResidualPolicy(ResidualConfig(inputs=["state", "base_action"], switch_dims=[5], switch_prob=0.05),
                            LOW, HIGH, base=base)
    obs = obs_batch(b=3)
    policy.reset(), base.reset()
    np.testing.assert_allclose(policy.predict(obs)[:, 0].numpy(), base.predict(obs)[:, 0].numpy(), atol=1e-5)
    x = torch.zeros(4000, policy.norm.mean.shape[0])
    dist = policy.dist(x)
    picks = dist.sample()[:, 5]
    assert abs(float((picks == 1).float().mean()) - 0.05) < 0.015 and abs(float((picks == 2).float().mean()) - 0.05) < 0.015
    assert torch.equal(dist.mode()[:, 5], torch.zeros(4000))  # the most probable setting: keep the base's
    base_norm = torch.full((3, 6), 0.25)
    r = torch.zeros(3, 6)
    r[:, 5] = torch.tensor([0.0, 1.0, 2.0])
    r[:, 0] = 1.0  # a continuous dimension still shifts by scale * r
    act = policy.env_action(base_norm, r)
    torch.testing.assert_close(act[:, 5], torch.tensor([0.25 * 20, -20.0, 20.0]))
    torch.testing.assert_close(act[:, 0], torch.full((3,), (0.25 + 0.1) * 20))
    # the log-probability is the Gaussian's over the other dimensions plus the chosen setting's
    d3 = policy.dist(torch.zeros(3, policy.norm.mean.shape[0]))
    gauss = d3.normal.log_prob(r)[:, :5].sum(-1)
    cat = torch.log(torch.tensor([0.9, 0.05, 0.05]))
    torch.testing.assert_close(policy.log_prob(d3, r, clipped=False), gauss + cat)
    # PPO moves the switch: a bandit that pays for "high" when the first input is positive, else "low"
    torch.manual_seed(0)
    bandit = ResidualPolicy(ResidualConfig(inputs=["state"], hidden=[32], switch_dims=[0], switch_prob=0.1),
                            -np.ones(2), np.ones(2), base=tiny_base(action_dim=2), state_dim=6)
    xs = torch.randn(512, bandit.norm.mean.shape[0])
    ppo_bandit(bandit, xs, lambda r: r[:, 0] == torch.where(xs[:, 0] > 0, 2.0, 1.0), 40)
    with torch.no_grad():
        chosen = bandit.dist(xs).mode()[:, 0]
    assert (chosen == torch.where(xs[:, 0] > 0, 2.0, 1.0)).float().mean() > 0.9
    # a switch alone: joints at scale 0 carry no likelihood, and their gradient stays finite
    only = ResidualPolicy(ResidualConfig(inputs=["state"], switch_dims=[5], scale_per_dim=[0.0] * 5 + [1.0]),
                          LOW, HIGH, base=base)
    d0 = only.dist(torch.zeros(3, only.norm.mean.shape[0]))
    s0 = d0.sample()
    lp = only.log_prob(d0, s0, torch.zeros(3, 6))
    torch.testing.assert_close(lp, d0.switch_log_prob(s0))
    lp.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in only.actor.parameters())
    with pytest.raises(PolicyError, match="needs a base"):
        ScratchPolicy(ResidualConfig(inputs=["state"], switch_dims=[0]), LOW, HIGH, state_dim=6)
    with pytest.raises(PolicyError, match="has 6 dimensions"):
        ResidualPolicy(ResidualConfig(inputs=["state"], switch_dims=[6]), LOW, HIGH, base=base)
    with pytest.raises(ValueError, match="switch_prob"):
        ResidualConfig(switch_dims=[5], switch_prob=0.5)
    with pytest.raises(ValueError, match="distinct"):
        ResidualConfig(switch_dims=[5, 5])


def test_a_tcp_residual_moves_the_commanded_tool_point_by_its_offset_in_metres():
    """``residual.tcp``: dimensions 0-2 move the base's commanded tool-centre point in the world
    frame (through the arm's Jacobian); an untrained residual is the base; the offset has no box."""
    from sim_envs.arm import so101
    from sim_envs.arm.ik import ArmIK

    low, high = so101.JOINT_LOW.astype(np.float32), so101.JOINT_HIGH.astype(np.float32)
    base = tiny_base()
    cfg = ResidualConfig(inputs=["state", "base_action"], tcp="so101", scale_per_dim=[0.01, 0.01, 0.01, 0, 0, 1],
                         switch_dims=[5], log_std=-1.0)
    policy = ResidualPolicy(cfg, low, high, base=base)
    obs = obs_batch(b=2)
    policy.reset(), base.reset()
    np.testing.assert_allclose(policy.predict(obs)[:, 0].numpy(), np.clip(base.predict(obs)[:, 0].numpy(), low, high),
                               atol=1e-5)
    ik = ArmIK()
    q, _ = ik.analytic(np.array([0.17, 0.05, 0.06]))  # an arm pose over the table
    command = np.concatenate([q, [0.3]]).astype(np.float32)
    base_norm = torch.as_tensor((command - policy.action_loc.numpy()) / policy.action_half.numpy())[None].repeat(3, 1)
    r = torch.zeros(3, 6)
    r[0, 0], r[1, 1], r[2, :3] = 1.0, -0.5, torch.tensor([0.5, 0.5, -0.5])
    r[:, 5] = 2.0  # the switch still acts: fully open
    act = policy.env_action(base_norm, r).numpy()
    start, _ = ik.fk(command)
    for row, want in zip(act, ([0.01, 0, 0], [0, -0.005, 0], [0.005, 0.005, -0.005])):
        moved, _ = ik.fk(row)
        np.testing.assert_allclose(moved - start, want, atol=5e-4)  # first order: within half a millimetre
        assert row[4] == pytest.approx(command[4], abs=1e-5) and row[5] == pytest.approx(high[5])
    # the offset has no action box: a sample far out scores by its density, not by a tail mass
    d = policy.dist(torch.zeros(1, policy.norm.mean.shape[0]))
    far = torch.tensor([[1000.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # beyond any box at scale 0.01 (|bound| <= 2 / 0.01)
    torch.testing.assert_close(policy.log_prob(d, far, base_norm[:1]), policy.log_prob(d, far, clipped=False))
    # and its gradient is finite wherever the mean is (the tail of an unbounded dimension is not evaluated:
    # log_ndtr's float32 gradient is NaN at some arguments near -1e6 sigma, which a far bound reached)
    mus = torch.linspace(-3.0, 3.0, 4001)[:, None].repeat(1, 6).requires_grad_()
    spread = torch.distributions.Normal(mus, torch.full_like(mus, float(np.exp(-1.0))))
    policy.log_prob(spread, torch.zeros(4001, 6), base_norm[:1].expand(4001, -1)).sum().backward()
    assert torch.isfinite(mus.grad).all()
    # with a bound the offset has that box: beyond it a sample executes at it and scores by the tail mass
    bounded = ResidualPolicy(dataclasses.replace(cfg, bound=2.0), low, high, base=base)
    out, at = torch.zeros(1, 6), torch.zeros(1, 6)
    out[0, 0], at[0, 0] = 5.0, 2.0
    np.testing.assert_allclose(bounded.env_action(base_norm[:1], out).numpy(), bounded.env_action(base_norm[:1], at).numpy())
    assert not np.allclose(policy.env_action(base_norm[:1], out).numpy(), policy.env_action(base_norm[:1], at).numpy())
    d = bounded.dist(torch.zeros(1, bounded.norm.mean.shape[0]))  # mean 0, std e^-1
    tail = torch.special.log_ndtr(torch.tensor(-2.0 / float(np.exp(-1.0))))
    inside = torch.distributions.Normal(0.0, float(np.exp(-1.0))).log_prob(torch.tensor(0.0))
    # only dimension 0 differs from the all-zero sample: its density at 0 becomes the mass beyond 2
    torch.testing.assert_close(bounded.log_prob(d, out, base_norm[:1]) - bounded.log_prob(d, torch.zeros(1, 6), base_norm[:1]),
                               (tail - inside)[None])
    with pytest.raises(PolicyError, match="needs a base"):
        ScratchPolicy(ResidualConfig(inputs=["state"], tcp="so101"), low, high, state_dim=6)
    with pytest.raises(PolicyError, match="5 joints"):
        ResidualPolicy(ResidualConfig(inputs=["state"], tcp="so101"), -np.ones(2), np.ones(2),
                       base=tiny_base(action_dim=2))
    with pytest.raises(ValueError, match="unknown arm"):
        ResidualConfig(tcp="ur5")
    with pytest.raises(ValueError, match="cannot be switch_dims"):
        ResidualConfig(tcp="so101", switch_dims=[2])


def test_the_base_tcp_input_is_where_the_base_command_puts_the_tool_point():
    """``base_tcp``: the forward kinematics of the base's commanded joints, in the residual's input
    after the inputs listed before it; it needs ``tcp`` and a base."""
    from sim_envs.arm import so101
    from sim_envs.arm.ik import ArmIK

    low, high = so101.JOINT_LOW.astype(np.float32), so101.JOINT_HIGH.astype(np.float32)
    base = tiny_base()
    policy = ResidualPolicy(ResidualConfig(inputs=["state", "base_tcp"], tcp="so101"), low, high, base=base)
    assert policy.input_dims == {"state": 6, "base_tcp": 3}
    obs = obs_batch(b=2)
    policy.reset(), base.reset()
    x, _ = policy.residual_input(obs)
    base.reset()
    command = np.clip(base.predict(obs)[:, 0].numpy(), low, high)
    want = np.stack([ArmIK().fk(row.astype(np.float64))[0] for row in command])
    np.testing.assert_allclose(x[:, 6:].numpy(), want, atol=1e-5)
    assert not np.allclose(want[0], want[1])  # two different commands, two different points
    with pytest.raises(ValueError, match="base_tcp"):
        ResidualConfig(inputs=["state", "base_tcp"])
    with pytest.raises(PolicyError, match="needs a base"):
        ScratchPolicy(ResidualConfig(inputs=["state", "base_tcp"], tcp="so101"), low, high, state_dim=6)


def test_dual_clip_bounds_negative_advantage_samples_whose_ratio_exploded():
    new = torch.tensor([5.0, 5.0, 0.05, 0.05], requires_grad=True)  # log-ratios: e^5 twice, ~1.05 twice
    old = torch.zeros(4)
    adv = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    plain, _ = ppo_loss(new, old, adv, 0.2)
    (g_plain,) = torch.autograd.grad(plain, new)
    dual, _ = ppo_loss(new, old, adv, 0.2, dual_clip=3.0)
    (g_dual,) = torch.autograd.grad(dual, new)
    # plain PPO: the exploded negative-advantage sample's gradient grows with its ratio (e^5 / 4)
    assert g_plain[0].item() == pytest.approx(np.exp(5.0) / 4, rel=1e-4)
    assert g_dual[0].item() == 0.0 and g_dual[1].item() == 0.0  # bounded / clipped: no gradient
    torch.testing.assert_close(g_dual[2:], g_plain[2:])  # inside the clip range: unchanged
    assert dual.item() == pytest.approx((3.0 - 1.2) / 4, rel=1e-4)  # -(-3 + 1.2 - r + r) / 4


def test_gae_and_reward_scale():
    rewards = torch.tensor([[0.0], [0.0], [1.0]])
    values = torch.zeros(3, 1)
    dones = torch.tensor([[0.0], [0.0], [1.0]])
    adv, ret = gae(rewards, values, dones, torch.tensor([5.0]), gamma=0.5, lam=1.0)
    np.testing.assert_allclose(adv[:, 0].numpy(), [0.25, 0.5, 1.0])  # the bootstrap is cut by done
    scaler = RewardScaler(1, 0.99, clip=5.0)
    out = [scaler(np.array([1.0]), np.array([False]))[0] for _ in range(50)]
    assert all(abs(v) <= 5.0 for v in out)


def test_dagger_filter_drops_unreliable_labels():
    frame = {"flags": np.array([0.0, 0.0, 0.0, 0.0]), "pre_failure": False}
    lost = {"flags": np.array([1.0, 0.0, 1.0, 0.0]), "pre_failure": False}
    crash = {"flags": np.array([0.0, 1.0, 0.0, 0.0]), "pre_failure": False}
    occluded = {"flags": np.array([0.0, 0.0, 1.0, 0.0]), "pre_failure": False}
    walled = {"flags": np.array([0.0, 0.0, 0.0, 1.0]), "pre_failure": False}
    before_fail = {"flags": np.array([0.0, 0.0, 0.0, 0.0]), "pre_failure": True}
    every = ["target_lost", "near_collision", "pre_failure"]
    assert [dagger.keep(f, every) for f in (frame, lost, crash, before_fail, walled)] == [True, False, False, False, True]
    assert dagger.keep(occluded, every) and not dagger.keep(occluded, ["target_unseen"])
    from sim_envs.wrappers import label_flags
    seen = {"visible": True, "distance": 2.0, "lost_counter": 0, "min_person_distance": 2.0}
    assert label_flags({"metrics": seen}).tolist() == [0, 0, 0, 0]
    assert label_flags({"metrics": dict(seen, visible=False)}).tolist() == [0, 0, 1, 0]  # occluded, in range
    assert label_flags({"metrics": dict(seen, visible=False, distance=3.5)}).tolist() == [1, 0, 1, 0]
    assert label_flags({"metrics": dict(seen, min_person_distance=0.5)}).tolist() == [0, 1, 0, 0]
    assert label_flags({"metrics": seen, "robot_clearance": 0.3}).tolist() == [0, 0, 0, 1]  # a wall 0.3 m ahead
    assert label_flags({"metrics": seen, "robot_clearance": 0.8}).tolist() == [0, 0, 0, 0]
    assert label_flags({}).tolist() == [0, 0, 0, 0]  # an env without tracking metrics (the arm)
    # unrecoverable drops only the pre-failure states the oracle could not have saved either
    saved = dict(before_fail, unrecoverable=False)
    doomed = dict(before_fail, unrecoverable=True)
    probed = ["target_lost", "near_collision", "unrecoverable"]
    assert [dagger.keep(f, probed) for f in (frame, saved, doomed)] == [True, True, False]
    assert dagger.flag_counts([frame, lost, saved, doomed, walled]) == {
        "target_lost": 1, "near_collision": 0, "target_unseen": 1, "near_obstacle": 1, "pre_failure": 2,
        "unrecoverable": 1, "rescue": 0}
    with pytest.raises(ValueError, match="recover_horizon"):
        dagger.DAggerConfig(recover_horizon=0)
    assert all(dagger.keep(f, []) for f in (frame, lost, crash, before_fail))  # no filter: keep all
    assert dagger.keep(crash, ["target_lost"]) and not dagger.keep(lost, ["target_lost"])
    with pytest.raises(ValueError, match="unknown"):
        dagger.DAggerConfig(filter=["nope"])
    # chunk labels: the clean labels of the next H visited steps, padded at the episode end
    episode = dagger._with_chunks([{"label": np.full(6, i, np.float32), "obs": {}} for i in range(3)])
    base = tiny_base()
    for f in episode:
        f["obs"] = {k: (v[0] if k != "task" else v[0]) for k, v in obs_batch(1).items()}
    batch = dagger.make_batch(episode, base)
    assert batch["action"].shape == (3, 6, 6)
    assert batch["action_is_pad"][2].tolist() == [False] + [True] * 5
    assert float(batch["action"][1, 0, 0]) == 1.0 and float(batch["action"][1, 1, 0]) == 2.0
    assert torch.isfinite(base.losses(batch, {"action": 1.0})["total"])


def test_recoverability_probe_flags_only_the_states_the_oracle_cannot_save():
    """A robot that stands still loses its target; the probe asks, for each of the last states,
    whether the oracle taking over there would have kept it. Asking must not change the episode."""
    from robopolicy.eval.envs import make_task_env

    cfg = EnvConfig("robopolicy/PersonFollow-v0", {"split": "dt", "image_size": 32})
    ends = []
    for window in (0, 15):
        env = make_task_env(cfg, oracle=True, probe_window=window, probe_horizon=20)
        env.reset(seed=1)
        for steps in range(1, 300):
            _, _, term, trunc, info = env.step(np.zeros(2, np.float32))
            if window and not (term or trunc):
                assert not info["unrecoverable"].any()  # only a failed episode's end is probed
            if term or trunc:
                break
        assert info["metrics"]["lost"]
        ends.append((steps, info["robot_pose"].tolist(), info["target_distance"]))
        env.close()
    assert ends[0] == ends[1]  # the counterfactual probes leave the episode as it was
    flags = info["unrecoverable"]
    assert flags.shape == (15,) and flags[-1] == 1.0 and flags[0] == 0.0  # saved early, doomed late
    assert np.all(np.diff(flags) >= 0)  # once the oracle cannot save it, later states are lost too
    with pytest.raises(ValueError, match="oracle_recovers"):
        make_task_env(EnvConfig("robopolicy/ArmReach-v0", {"use_cameras": False}), oracle=True, probe_window=5)


def _still_waypoint_policy():
    """A waypoint policy whose waypoints all sit at the robot: it stands still."""
    torch.manual_seed(0)
    cfg = PolicyConfig(head="waypoints", cameras=["front"], encoders=[EncoderConfig(name="test_resnet", image_size=32)],
                       grid=2, context_strides=[0], horizon=8, language=LanguageConfig(enabled=False), d_model=32,
                       n_heads=2, n_layers=1, head_layers=1, action_shape=[8, 3], state_dim=2, frame_size=[32, 32])
    stats = {k: {s: np.full(shape, v, np.float32) for s, v in
                 (("mean", 0), ("std", 1e-4), ("min", -1e-4), ("max", 1e-4), ("q01", -1e-4), ("q99", 1e-4))}
             for k, shape in (("action", (8, 3)), ("observation.state", (2,)))}
    return Policy(cfg, stats).eval()


def test_dagger_marks_the_unrecoverable_states_before_each_failure():
    """Tracking DAgger with a policy that stands still (waypoints at the robot): every episode ends
    lost; ``unrecoverable`` marks a suffix of its last ``pre_failure_steps`` states."""
    still = _still_waypoint_policy()
    dcfg = dagger.DAggerConfig(env=EnvConfig("robopolicy/PersonFollow-v0", {"split": "dt", "image_size": 32}),
                               steps_per_iteration=130, num_envs=1, pre_failure_steps=10, recover_horizon=20,
                               filter=["unrecoverable"])
    frames = dagger.collect(still, dcfg, 0.0, np.random.default_rng(0), 8)
    ends = [j for j, f in enumerate(frames) if f["index"] == len(f["episode"]) - 1 and f["pre_failure"]]
    assert len(ends) >= 1  # at least one episode ended lost within 130 steps
    for end in ends:
        last = frames[end - 9:end + 1]
        assert all(f["pre_failure"] for f in last) and not frames[end - 10]["pre_failure"]
        marks = [f["unrecoverable"] for f in last]
        assert marks[-1] and marks == sorted(marks)  # doomed at the end, saved before, no going back
    counts = dagger.flag_counts(frames)
    assert 0 < counts["unrecoverable"] < counts["pre_failure"]
    assert sum(dagger.keep(f, dcfg.filter) for f in frames) == len(frames) - counts["unrecoverable"]
    # rescue states: the probed ones the oracle still saves
    assert all(f["rescue"] == (f["pre_failure"] and not f["unrecoverable"]) for f in frames)
    assert counts["rescue"] == counts["pre_failure"] - counts["unrecoverable"] > 0


def test_dagger_draws_flagged_states_by_their_weight(monkeypatch):
    """``weights`` {flag: w}: a state with that flag is drawn w times as often as an unflagged one;
    the factors of several flags multiply."""
    drawn: list[dict] = []
    monkeypatch.setattr(dagger, "make_batch", lambda frames, policy, scene=None: drawn.extend(frames) or {})

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def losses(self, batch, weights):
            return {"total": (self.w ** 2).sum()}

    # 10 rescue states, 10 near an obstacle (5 of them both), 85 others
    data = [{"rescue": i < 10, "flags": np.array([0, 0, 0, float(5 <= i < 15)])} for i in range(100)]
    shares = []
    for weights in ({}, {"rescue": 9.0}, {"rescue": 3.0, "near_obstacle": 3.0}):
        drawn.clear()
        cfg = dagger.DAggerConfig(weights=weights, finetune_steps=200, batch_size=32)
        dagger.finetune(Stub(), data, cfg, random.Random(0))
        shares.append(sum(f["rescue"] and f["flags"][3] > 0 for f in drawn) / len(drawn))
    # the 5 with both flags: 5 of 100; 45 of 180 by the rescue weight; 45 of 90 + 5*3 + 5*3 + 85 = 160
    assert abs(shares[0] - 0.05) < 0.02 and abs(shares[1] - 0.25) < 0.04 and abs(shares[2] - 45 / 160) < 0.04
    assert dagger.draw_weight(data[7], {"rescue": 3.0, "near_obstacle": 2.0}) == 6.0
    assert dagger.draw_weight(data[50], {"rescue": 3.0, "near_obstacle": 2.0}) == 1.0
    with pytest.raises(ValueError, match="weights"):
        dagger.DAggerConfig(weights={"rescue": 0})
    with pytest.raises(ValueError, match="unknown flag"):
        dagger.DAggerConfig(weights={"near_wall": 2.0})


def test_rpd_bc_term_pulls_the_student_toward_the_teacher(tmp_path):
    from robopolicy.refine import rpd

    env = EnvConfig("robopolicy/ArmReach-v0", {"use_cameras": False, "max_steps": 20})
    cfg = rpd.RPDConfig(env=env, total_env_steps=512, num_envs=1, num_steps=128, update_epochs=20, minibatches=2,
                        actor_lr=3e-3, bc_weight=10.0, target_kl=10.0, eval_every=10_000, eval_episodes=1, eval_envs=1,
                        out=str(tmp_path / "rpd"), progress=False,
                        student=ResidualConfig(inputs=["state", "environment_state"], hidden=[32], log_std=-2.0))
    obs_space_dims = dict(state_dim=6, env_state_dim=17)  # ArmReach: ArmEnv.env_state_dim
    from sim_envs.arm import so101

    low, high = so101.JOINT_LOW.astype(np.float32), so101.JOINT_HIGH.astype(np.float32)
    teacher = ScratchPolicy(ResidualConfig(inputs=["state"], hidden=[8]), low, high, state_dim=6)
    with torch.no_grad():
        teacher.actor[-1].bias.fill_(0.5)  # constant teacher: 0.5 in normalized units on every joint
    summary = rpd.train(cfg, teacher=teacher, log=lambda s: None)
    student = load_policy(summary["checkpoint"])
    assert student.input_dims == {"state": obs_space_dims["state_dim"], "environment_state": obs_space_dims["env_state_dim"]}
    x = torch.randn(64, sum(student.input_dims.values()))
    with torch.no_grad():
        mean = student.dist(student.norm(x * student.norm.var.sqrt() + student.norm.mean)).mean
    # untrained student: mean 0 (zero last layer), 0.5 from the teacher; BC pulls it most of the way
    assert (mean - 0.5).abs().mean() < 0.2
    assert summary["size_ratio"] > 0 and summary["latency_ms"]["student"] > 0


def test_bad_inputs_give_clear_errors(tmp_path):
    from robopolicy.refine import residual_ppo

    base = tiny_base(action_dim=2)
    base_dir = base.save(tmp_path / "base2d")
    cfg = residual_ppo.ResidualPPOConfig(env=EnvConfig("robopolicy/ArmReach-v0", {"use_cameras": False}),
                                         base=str(base_dir))
    with pytest.raises(PolicyError, match="2-D actions but the env takes 6-D"):
        residual_ppo.build_policy(cfg)
    with pytest.raises(PolicyError, match="need a base"):
        ScratchPolicy(ResidualConfig(inputs=["state", "features"]), LOW, HIGH, state_dim=6)
    with pytest.raises(PolicyError, match="ScratchPolicy"):  # no base: the policy learnt from scratch is its own class
        ResidualPolicy(ResidualConfig(inputs=["state"]), LOW, HIGH, base=None, state_dim=6)
    with pytest.raises(ValueError, match="unknown"):
        ResidualConfig(inputs=["pixels"])
    # a residual checkpoint whose base was removed
    ckpt = ResidualPolicy(ResidualConfig(), LOW, HIGH, base=tiny_base()).save(tmp_path / "res")
    import shutil

    shutil.rmtree(ckpt / BASE_DIR)
    with pytest.raises(PolicyError, match="base policy is missing"):
        load_policy(ckpt)


def test_combined_checkpoint_round_trips_and_runs_in_eval(tmp_path):
    policy = ResidualPolicy(ResidualConfig(execute_steps=3), LOW, HIGH, base=tiny_base())
    torch.nn.init.normal_(policy.actor[-1].weight, std=0.1)
    policy.norm.update(torch.randn(50, policy.norm.mean.shape[0]) * 3)
    obs = obs_batch()
    ref = [policy.predict(obs) for _ in range(4)]
    ckpt = policy.save(tmp_path / "refined")
    loaded = load_policy(ckpt)
    assert isinstance(loaded, ResidualPolicy) and isinstance(load_policy(ckpt / BASE_DIR), Policy)
    loaded.reset()
    for r in ref:
        torch.testing.assert_close(loaded.predict(obs), r)

    from robopolicy.eval import EvalConfig, evaluate

    report = evaluate(loaded, EvalConfig(env=EnvConfig("robopolicy/ArmReach-v0", {"max_steps": 8}), episodes=2,
                                         workers=1, videos=0, progress=False), log=lambda s: None, save=False)
    assert report.splits[0].env_steps == 16


def test_worker_serves_a_saved_checkpoint_and_its_refined_form(tmp_path):
    from robopolicy.deploy.worker import load_policy

    base = tiny_base()
    base.save(tmp_path / "plain")
    with pytest.raises(ValueError, match="control rate"):  # no run config naming its dataset
        load_policy(str(tmp_path / "plain"))
    (tmp_path / "train_config.yaml").write_text(f"data: {{dataset: {tmp_path / 'ds'}}}\n")
    (tmp_path / "ds" / "meta").mkdir(parents=True)
    (tmp_path / "ds" / "meta" / "info.json").write_text('{"fps": 20}')
    worker_policy = load_policy(str(tmp_path / "plain"))
    assert worker_policy.kind == "action" and worker_policy.dt == pytest.approx(0.05)
    obs = {k: (v[0] if k != "task" else v[0]) for k, v in obs_batch(1).items()}
    chunk = worker_policy.predict(obs, 0.0)
    with torch.inference_mode():
        expected = base.predict(obs_batch(1))[0].numpy()
    assert chunk.shape == (6, 6) and np.allclose(chunk, expected, atol=1e-5)
    worker_policy.reset()
    assert worker_policy.predict(obs, 0.05).shape == (6, 6)


def test_tracking_metrics_pool_episodes_as_the_task_defines_them():
    eps = [{"success": 1.0, "collision": 0.0, "lost": 0.0, "following_steps": 90.0, "steps": 100.0, "reference_steps": 100.0},
           {"success": 0.0, "collision": 1.0, "lost": 0.0, "following_steps": 1.0, "steps": 10.0, "reference_steps": 10.0},
           {"success": 0.0, "collision": 1.0, "person_collision": 1.0, "lost": 0.0, "following_steps": 0.0, "steps": 10.0,
            "reference_steps": 10.0}]
    m = tracking_metrics(eps)
    # pooled: 91 following steps over 120 (a per-episode mean of 0.9, 0.1 and 0 would say 0.33)
    assert m == pytest.approx({"collision": 2 / 3, "person_collision": 1 / 3, "lost": 0.0, "tracking_rate": 91 / 120})
    assert tracking_metrics([{"success": 1.0, "steps": 40.0}]) == {}  # arm episodes carry none
    assert tracking_metrics([]) == {}


def test_evaluation_seeds_each_episode_as_robopolicy_eval_does():
    """Episode e starts from seed + e whichever env runs it: 1 env and 2 envs measure the same
    episodes, and a shifted seed measures other ones."""
    env = EnvConfig("robopolicy/ArmReach-v0", {"use_cameras": False, "max_steps": 5})

    def run(num_envs, seed):
        hold = lambda obs: np.asarray(obs["observation.state"], np.float32)  # noqa: E731
        res = evaluate_success(hold, lambda rows: None, env, episodes=3, num_envs=num_envs, seed=seed)
        assert res.episodes == 3 and res.env_steps == 15
        return [r["final_distance"] for r in res.records]

    one = run(1, 7)
    assert run(2, 7) == one
    assert run(1, 8)[:2] == one[1:]


def test_chunk_actor_predicts_chunks_round_trips_and_runs_in_eval(tmp_path):
    with pytest.raises(PolicyError, match="without a base"):
        ResidualPolicy(ResidualConfig(chunk=4), LOW, HIGH, base=tiny_base())
    policy = ScratchPolicy(ResidualConfig(inputs=["state"], hidden=[16], chunk=4), LOW, HIGH, state_dim=6)
    torch.nn.init.normal_(policy.actor[-1].weight, std=0.1)
    obs = obs_batch(3)
    chunk = policy.predict(obs)
    assert chunk.shape == (3, 4, 6) and policy.horizon == 4
    assert not torch.allclose(chunk[:, 0], chunk[:, 1])  # four different actions, not one repeated
    x = policy.norm(policy.residual_input(obs)[0])
    assert policy.dist(x).mean.shape == (3, 24)
    loaded = load_policy(policy.save(tmp_path / "chunk"))
    torch.testing.assert_close(loaded.predict(obs), chunk)

    from robopolicy.eval import EvalConfig, evaluate

    report = evaluate(loaded, EvalConfig(env=EnvConfig("robopolicy/ArmReach-v0", {"max_steps": 8, "use_cameras": False}),
                                         episodes=2, workers=1, videos=0, progress=False), log=lambda s: None, save=False)
    split = report.splits[0]
    assert split.env_steps == 16 and split.policy_calls == 4  # each chunk runs in full: 2 per 8-step episode


def _smdp_gae(records, tail, lam):
    """Reference semi-MDP GAE written over each env's decision records: ``R`` the discounted reward
    over the steps a decision's actions ran, ``g`` the discount to the next decision (γ^steps),
    ``tail[i]`` the value after env i's last decision; λ applied once per decision (at λ = 1 the
    same as robopolicy.rl.gae's λ^k trace)."""
    flat, adv, ret = [], [], []
    for i, recs in enumerate(records):
        a_next, v_next = 0.0, float(tail[i])
        out = []
        for rec in reversed(recs):
            v = float(rec["v"])
            live = 0.0 if rec["done"] else 1.0
            delta = rec["R"] + live * rec["g"] * v_next - v
            a_next = delta + live * rec["g"] * lam * a_next
            out.append((rec, a_next, a_next + v))
            v_next = v
        for rec, a, r in reversed(out):
            flat.append(rec)
            adv.append(a)
            ret.append(r)
    return flat, torch.tensor(adv, dtype=torch.float32), torch.tensor(ret, dtype=torch.float32)


def test_smdp_gae_is_per_step_gae_for_one_step_decisions_and_discounts_chunks():
    rng = np.random.default_rng(0)
    T, gamma, lam = 6, 0.9, 0.8
    rew, val = rng.normal(size=(T, 1)), rng.normal(size=(T, 1))
    dones = np.zeros((T, 1))
    dones[2] = 1
    last = 0.7
    ref_adv, ref_ret = gae(torch.tensor(rew, dtype=torch.float32), torch.tensor(val, dtype=torch.float32),
                           torch.tensor(dones, dtype=torch.float32), torch.tensor([last], dtype=torch.float32),
                           gamma, lam)
    recs = [[{"R": float(rew[t, 0]), "g": gamma, "v": float(val[t, 0]), "done": bool(dones[t, 0])} for t in range(T)]]
    _, adv, ret = _smdp_gae(recs, {0: last}, lam)
    torch.testing.assert_close(adv, ref_adv[:, 0])
    torch.testing.assert_close(ret, ref_ret[:, 0])
    # one 3-step chunk (rewards 1, 0, 2), then the value 5 after it: with lambda 1 the advantage is
    # the discounted return minus the value at the decision
    rec = {"R": 1 + gamma**2 * 2, "g": gamma**3, "v": 0.5, "done": False}
    _, adv, _ = _smdp_gae([[rec]], {0: 5.0}, 1.0)
    assert adv.item() == pytest.approx(1 + gamma**2 * 2 + gamma**3 * 5 - 0.5, rel=1e-6)


def test_rpd_chunk_student_learns_the_teachers_chunks(tmp_path):
    from robopolicy.refine import rpd
    from sim_envs.arm import so101

    env = EnvConfig("robopolicy/ArmReach-v0", {"use_cameras": False, "max_steps": 20})
    torch.manual_seed(0)
    cfg = PolicyConfig(head="chunk_l1", cameras=[], use_state=True, context_strides=[0], horizon=6,
                       language=LanguageConfig(enabled=False), d_model=16, n_heads=2, n_layers=1, head_layers=1,
                       action_shape=[6], state_dim=6)
    mid = ((so101.JOINT_LOW + so101.JOINT_HIGH) / 2).astype(np.float32)
    half = ((so101.JOINT_HIGH - so101.JOINT_LOW) / 2).astype(np.float32)
    stats = {"action": {"mean": mid + 0.3 * half, "std": np.full(6, 1e-3, np.float32)},
             "observation.state": {"mean": np.zeros(6, np.float32), "std": np.ones(6, np.float32)}}
    teacher = Policy(cfg, {k: {**v, **{s: v["mean"] for s in ("min", "max", "q01", "q99")}} for k, v in stats.items()})
    student = ResidualConfig(inputs=["state", "environment_state"], hidden=[32], log_std=-2.0, chunk=4)
    rcfg = rpd.RPDConfig(env=env, total_env_steps=512, num_envs=1, num_steps=128, update_epochs=20, minibatches=2,
                         actor_lr=3e-3, bc_weight=10.0, target_kl=1e3, eval_every=10_000, eval_episodes=1, eval_envs=1,
                         out=str(tmp_path / "rpd"), progress=False, student=student)
    summary = rpd.train(rcfg, teacher=teacher.eval(), log=lambda s: None)
    learned = load_policy(summary["checkpoint"])
    assert learned.horizon == 4 and load_policy(summary["best_checkpoint"]).horizon == 4
    from robopolicy.eval.envs import make_task_env

    probe = make_task_env(env, privileged=True)
    obs = [probe.reset(seed=s)[0] for s in (5, 6)]  # states like the visited ones
    probe.close()
    obs = {k: np.stack([o[k] for o in obs]) for k in ("observation.state", "observation.environment_state")}
    target = teacher.predict(obs)[:, :4]  # ~ mid + 0.3 * half on every step (std 1e-3 squeezes the head)
    # untrained: the box centre (0.3 half-ranges away); BC brings the whole chunk most of the way
    err = ((learned.predict(obs) - target) / torch.as_tensor(half)).abs().mean()
    assert err < 0.1
    # a KL limit the BC term alone exceeds ends each update after one step (the student hardly
    # moves) unless PPO has not joined yet: the BC warm-up is not cut short by the PPO's KL check
    errs = {}
    for warmup in (0, 10**6):
        rcfg.target_kl, rcfg.bc_warmup_steps, rcfg.out = 1e-9, warmup, str(tmp_path / f"rpd{warmup}")
        learned = load_policy(rpd.train(rcfg, teacher=teacher, log=lambda s: None)["checkpoint"])
        errs[warmup] = ((learned.predict(obs) - target) / torch.as_tensor(half)).abs().mean()
    assert errs[0] > 0.2 and errs[10**6] < 0.5 * errs[0]  # untrained: 0.3
    # once PPO has joined the actor learns at ppo_actor_lr: 0 leaves the untrained student as it is
    rcfg.target_kl, rcfg.bc_warmup_steps, rcfg.ppo_actor_lr, rcfg.out = 1e3, 0, 0.0, str(tmp_path / "lr0")
    frozen = load_policy(rpd.train(rcfg, teacher=teacher, log=lambda s: None)["checkpoint"])
    assert ((frozen.predict(obs) - target) / torch.as_tensor(half)).abs().mean() > 0.25
    rcfg.ppo_actor_lr = None
    # the BC term may sample an aggregate of past rollouts' states (bc_buffer) instead
    rcfg.target_kl, rcfg.bc_warmup_steps, rcfg.bc_buffer, rcfg.out = 1e3, 0, 300, str(tmp_path / "buf")
    learned = load_policy(rpd.train(rcfg, teacher=teacher, log=lambda s: None)["checkpoint"])
    assert ((learned.predict(obs) - target) / torch.as_tensor(half)).abs().mean() < 0.1
    with pytest.raises(PolicyError, match="chunk policy checkpoint"):
        rpd.train(rcfg, teacher=ScratchPolicy(ResidualConfig(inputs=["state"], hidden=[8]), so101.JOINT_LOW,
                                               so101.JOINT_HIGH, state_dim=6), log=lambda s: None)


def test_clipped_likelihood_scores_a_clipped_sample_by_the_mass_beyond_the_bound():
    from torch.distributions import Normal

    policy = ScratchPolicy(ResidualConfig(inputs=["state"], hidden=[8], chunk=2), LOW, HIGH, state_dim=6)
    mu = torch.tensor([[0.5, 0.0, 2.0, -0.5] + [0.0] * 8], requires_grad=True)
    std = torch.full_like(mu, 0.2)
    r = torch.tensor([[0.6, 1.3, 2.5, -1.7] + [0.0] * 8])  # inside, beyond +1, beyond +1, beyond -1
    dist = Normal(mu, std)
    got = policy.log_prob(dist, r)
    n01 = Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)  # float64: a tail of 3e-7 loses its digits in float32

    def log_cdf(z):
        return n01.cdf(torch.tensor(z, dtype=torch.float64)).log().float()

    want = (dist.log_prob(r)[0, 0] + log_cdf((0.0 - 1.0) / 0.2) + log_cdf((2.0 - 1.0) / 0.2)
            + log_cdf((-1.0 + 0.5) / 0.2) + dist.log_prob(r)[0, 4:].sum())
    torch.testing.assert_close(got, want[None])
    torch.testing.assert_close(policy.log_prob(dist, r, clipped=False), dist.log_prob(r).sum(-1))
    # a mean already past the bound gets (almost) no push further out from a clipped sample;
    # the density keeps pushing it by (r - mu) / std^2
    got.sum().backward()
    assert abs(mu.grad[0, 2].item()) < 1e-3 and mu.grad[0, 0].item() == pytest.approx((0.6 - 0.5) / 0.04, rel=1e-4)
    # with a base, the bounds on the residual sample move with the base action and the scale
    base = ResidualPolicy(ResidualConfig(inputs=["state"], hidden=[8], scale=0.5), LOW, HIGH, base=tiny_base())
    d1 = Normal(torch.zeros(1, 6), torch.ones(1, 6))
    base_norm = torch.full((1, 6), 0.8)  # executed: clip(0.8 + 0.5 r): the bound is at r = 0.4
    inside, beyond = torch.full((1, 6), 0.3), torch.full((1, 6), 0.5)
    torch.testing.assert_close(base.log_prob(d1, inside, base_norm), d1.log_prob(inside).sum(-1))
    torch.testing.assert_close(base.log_prob(d1, beyond, base_norm), (6 * log_cdf(-0.4))[None])


@pytest.mark.parametrize("kl_stop", ["actor", "update"])
def test_ppo_from_scratch_learns_a_task_with_a_known_answer(tmp_path, kl_stop):
    """Whichever the KL stop ends (the actor's epochs, or the whole update as RPD's does), PPO
    learns PointReach."""
    from robopolicy.refine import residual_ppo

    cfg = residual_ppo.ResidualPPOConfig(env=EnvConfig("robopolicy/PointReach-v0"), reward="dense",
                                         residual=ResidualConfig(inputs=["state"], hidden=[64, 64], log_std=-0.5),
                                         total_env_steps=12_000, num_envs=2, num_steps=256, eval_every=12_000,
                                         eval_episodes=50, eval_envs=1, kl_stop=kl_stop, out=str(tmp_path / "ppo"),
                                         progress=False)
    summary = residual_ppo.train(cfg, log=lambda s: None)
    assert summary["before"] <= 0.1 and summary["after"] >= 0.8


def test_refine_saves_its_resolved_config_that_reruns_the_same_run(tmp_path, capsys):
    """``robopolicy refine`` writes ``refine_config.yaml`` (config file + overrides + defaults) into
    the run's directory; loaded back it is the same config, so a stage of a chain can be rerun. A
    refused command line writes nothing."""
    from robopolicy.cli import build_parser
    from robopolicy.config import load_config, to_dict
    from robopolicy.refine.residual_ppo import ResidualPPOConfig

    src = tmp_path / "scratch.yaml"
    src.write_text("residual: {inputs: [state], hidden: [16], log_std: -0.5}\nreward: dense\nnum_envs: 2\n")
    out = tmp_path / "run"
    argv = ["refine", "--method", "ppo", "--env", "robopolicy/PointReach-v0", "--config", str(src), "--out", str(out),
            "--no-progress", "total_env_steps=512", "num_steps=128", "eval_every=512", "eval_episodes=2",
            "eval_envs=1", "seed=7", "gamma=0.5"]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    saved = out / "refine_config.yaml"
    assert saved.read_text().startswith("# robopolicy refine --method ppo")
    again = load_config(ResidualPPOConfig, saved)
    expected = load_config(ResidualPPOConfig, src, ["env.id=robopolicy/PointReach-v0", f"out={out}",
                                                    "progress=false", *argv[-7:]])
    assert to_dict(again) == to_dict(expected)
    assert (again.seed, again.gamma, again.residual.hidden, again.num_steps) == (7, 0.5, [16], 128)
    assert not list(out.glob(".*tmp*"))

    refused = tmp_path / "refused"
    args = build_parser().parse_args(["refine", "--method", "ppo", "--checkpoint", str(tmp_path / "ckpt"), "--env",
                                      "robopolicy/PointReach-v0", "--out", str(refused)])
    assert args.func(args) == 2
    assert "drop --checkpoint" in capsys.readouterr().out and not refused.exists()


def test_stages_chain_runs_each_from_the_last_and_goes_on_after_a_stop(tmp_path, monkeypatch, capsys):
    """``stages``: stage 2 is stage 1's config with its changes, started from stage 1's final
    residual; the chain's curve runs over both; a rerun skips finished stages, refuses a finished
    stage of other settings, and a bad stage fails before anything runs."""
    from robopolicy.config import ConfigError, load_config
    from robopolicy.refine import residual_ppo, stages

    def chain(**stage2):
        return residual_ppo.ResidualPPOConfig(
            env=EnvConfig("robopolicy/PointReach-v0"), reward="dense",
            residual=ResidualConfig(inputs=["state"], hidden=[32], log_std=-0.5), total_env_steps=1024, num_envs=2,
            num_steps=256, eval_every=512, eval_episodes=8, eval_envs=1, out=str(tmp_path / "chain"),
            progress=False, stages=[{"total_env_steps": 512, "actor_lr": 1e-4, "residual": {"log_std": -1.0},
                                     **stage2}])

    cfg = chain()
    with pytest.raises(ConfigError, match="runs through robopolicy.refine.stages"):
        residual_ppo.train(cfg, log=lambda s: None)
    for bad, match in (({"out": "x"}, r"stage 2 \(stages\[0\]\): 'out' is set by the chain"),
                       ({"out_dir": "x"}, r"stage 2 \(stages\[0\]\): 'out_dir' is set by the chain"),
                       ({"residual": {"hiden": [8]}}, r"stage 2 \(stages\[0\]\): unknown key 'residual.hiden'")):
        with pytest.raises(ConfigError, match=match):
            stages.train(chain(**bad), "ppo", log=lambda s: None)
        assert not (tmp_path / "chain" / "stage1").exists()

    lines = []
    result = stages.train(cfg, "ppo", log=lines.append)
    one, two = result["stages"]
    second = load_config(residual_ppo.ResidualPPOConfig, tmp_path / "chain" / "stage2" / "refine_config.yaml")
    assert second.init_residual == one["checkpoint"] == str(tmp_path / "chain" / "stage1" / "final")
    assert (second.actor_lr, second.residual.log_std, second.residual.hidden, second.total_env_steps) == \
        (1e-4, -1.0, [32], 512)
    assert two["before"] == one["after"]  # the same residual on the same evaluation seeds
    assert (result["before"], result["after"], result["env_steps"]) == (one["before"], two["after"], 1024 + 512)
    rows = list(csv.DictReader(open(tmp_path / "chain" / "curve.csv")))
    assert [(int(r["env_steps"]), int(r["stage"])) for r in rows] == [(0, 1), (512, 1), (1024, 1), (1536, 2)]
    assert sum("finished already" in line for line in lines) == 0
    assert sum(", seed 0" in line for line in lines if line.startswith("[stages] stage")) == 2

    monkeypatch.setattr(residual_ppo, "train", lambda *a, **k: pytest.fail("a finished stage ran again"))
    lines.clear()
    again = stages.train(cfg, "ppo", log=lines.append)
    assert again["after"] == result["after"] and sum("finished already" in line for line in lines) == 2
    from robopolicy.cli import build_parser
    from robopolicy.refine.common import save_run_config

    chain_yaml = save_run_config("ppo", cfg)  # what the command saves of the chain, here run by the command
    args = build_parser().parse_args(["refine", "--method", "ppo", "--config", str(chain_yaml)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert f"| after stage 2 (512 env steps; {two['checkpoint']}) | {100 * two['after']:.1f}% |" in printed
    with pytest.raises(ConfigError, match="stage2 holds a finished run with other settings"):
        stages.train(chain(gamma=0.5), "ppo", log=lambda s: None)


def test_stages_keep_their_own_seeds_and_the_rest_take_the_first_stages(tmp_path):
    """A stage that sets ``seed`` keeps it when the first stage's changes; the others follow it."""
    from robopolicy.refine import residual_ppo, stages

    def chain(seed):
        return residual_ppo.ResidualPPOConfig(
            env=EnvConfig("robopolicy/PointReach-v0"), residual=ResidualConfig(inputs=["state"]), seed=seed,
            out=str(tmp_path / "chain"), stages=[{"total_env_steps": 512}, {"gamma": 0.8, "seed": 8}])

    assert [c.seed for c in stages.stage_configs(chain(0))] == [0, 0, 8]
    assert [c.seed for c in stages.stage_configs(chain(10))] == [10, 10, 8]


def point_teacher(horizon: int = 8) -> Policy:
    """A chunk policy for PointReach that has learnt nothing: it stays where it is."""
    torch.manual_seed(0)
    cfg = PolicyConfig(head="chunk_l1", cameras=[], use_state=True, context_strides=[0], horizon=horizon,
                       language=LanguageConfig(enabled=False), d_model=16, n_heads=2, n_layers=1, head_layers=1,
                       action_shape=[2], state_dim=4)
    z = lambda d, v: np.full(d, v, np.float32)  # noqa: E731
    stats = {"action": {"mean": z(2, 0), "std": z(2, 1e-3)}, "observation.state": {"mean": z(4, 0.5), "std": z(4, 0.3)}}
    return Policy(cfg, {k: {**v, **{s: v["mean"] for s in ("min", "max", "q01", "q99")}} for k, v in stats.items()}).eval()


def test_rpd_student_surpasses_its_teacher_with_the_reward(tmp_path):
    from robopolicy.refine import rpd

    student = ResidualConfig(inputs=["state"], hidden=[64, 64], log_std=-0.5, chunk=4)
    cfg = rpd.RPDConfig(env=EnvConfig("robopolicy/PointReach-v0"), student=student, reward="dense",
                        total_env_steps=16_384, num_envs=2, num_steps=512, minibatches=1, update_epochs=10,
                        bc_weight=0.1, bc_decay=0.5, bc_min=0.0, target_kl=0.1, eval_every=16_384, eval_episodes=50,
                        eval_envs=1, out=str(tmp_path / "rpd"), progress=False)
    summary = rpd.train(cfg, teacher=point_teacher(), log=lambda s: None)
    assert summary["teacher_success"] <= 0.1 and summary["student_after"] >= 0.7
    rows = (tmp_path / "rpd" / "curve.csv").read_text().splitlines()
    assert rows[0].split(",")[-1] == "train_success" and len(rows) == 3
    # a later run may start from this student; another architecture is refused
    cfg.init_student, cfg.total_env_steps, cfg.out = summary["checkpoint"], 1024, str(tmp_path / "again")
    again = rpd.train(cfg, teacher=point_teacher(), log=lambda s: None)
    assert again["student_before"] >= 0.7
    cfg.student = ResidualConfig(inputs=["state"], hidden=[32], log_std=-0.5, chunk=4)
    with pytest.raises(PolicyError, match=r"not a student of this architecture \(hidden \[64, 64\] vs \[32\]\)"):
        rpd.train(cfg, teacher=point_teacher(), log=lambda s: None)


def test_gae_over_chunk_decisions_is_the_semi_mdp_gae():
    """Decisions every few steps (a chunk cut short by an episode's end included): the advantage at
    each decision is the semi-MDP one, the steps between decisions get none (λ = 1 here, where the
    trace's λ^k per decision and the reference's λ per decision agree)."""
    rng = np.random.default_rng(1)
    T, gamma, lam, last = 11, 0.9, 1.0, 0.7
    rew, val = rng.normal(size=T), rng.normal(size=T)
    dones = np.zeros(T)
    dones[4] = 1  # the episode ends inside the chunk decided at 3; the next one decides at 5
    starts = [0, 3, 5, 8]
    recs = []
    for j, s in enumerate(starts):
        end = starts[j + 1] if j + 1 < len(starts) else T
        steps = list(range(s, end))
        cut = next((t for t in steps if dones[t]), None)
        steps = steps if cut is None else steps[: steps.index(cut) + 1]
        recs.append({"R": sum(gamma ** (t - s) * rew[t] for t in steps), "g": gamma ** len(steps),
                     "v": float(val[s]), "done": cut is not None})
    _, ref_adv, ref_ret = _smdp_gae([recs], {0: last}, lam)
    dec = np.zeros(T)
    dec[starts] = 1
    as_t = lambda a: torch.tensor(a, dtype=torch.float32)[:, None]  # noqa: E731
    adv, ret = gae(as_t(rew), as_t(val), as_t(dones), torch.tensor([last], dtype=torch.float32), gamma, lam, as_t(dec))
    torch.testing.assert_close(adv[starts, 0], ref_adv)
    torch.testing.assert_close(ret[starts, 0], ref_ret)
    assert adv[[t for t in range(T) if t not in starts], 0].abs().max().item() == 0.0
    # λ < 1: the trace decays by λ per step, λ^k across a k-step chunk
    two = gae(torch.tensor([[0.0], [0.0], [1.0], [0.0]]), torch.tensor([[0.5], [9.0], [2.0], [9.0]]), torch.zeros(4, 1),
              torch.tensor([3.0]), 0.9, 0.5, torch.tensor([[1.0], [0.0], [1.0], [0.0]]))[0]
    later = 1.0 + 0.81 * 3.0 - 2.0  # the second decision: reward 1, then γ² to the bootstrap
    assert two[2, 0].item() == pytest.approx(later, rel=1e-5)
    assert two[0, 0].item() == pytest.approx(0.81 * 2.0 - 0.5 + 0.25 * 0.81 * later, rel=1e-5)
    # every step a decision: the same as ordinary GAE
    lam = 0.8
    plain = gae(as_t(rew), as_t(val), as_t(dones), torch.tensor([last], dtype=torch.float32), gamma, lam)
    ones = gae(as_t(rew), as_t(val), as_t(dones), torch.tensor([last], dtype=torch.float32), gamma, lam,
               torch.ones(T, 1))
    torch.testing.assert_close(plain[0], ones[0])
    torch.testing.assert_close(plain[1], ones[1])


def test_chunk_decisions_hold_the_residual_over_each_base_chunk():
    base = tiny_base()
    policy = ResidualPolicy(ResidualConfig(inputs=["state", "base_action"], execute_steps=3, decision="chunk"),
                            LOW, HIGH, base=base)
    torch.manual_seed(0)
    torch.nn.init.normal_(policy.actor[-1].weight)  # a trained residual: its output depends on the state
    policy.reset()
    held, fresh = [], []
    for t in range(7):
        obs = obs_batch(b=2, seed=t)  # a new state every step
        if t == 3:
            policy.residual_input(obs, peek=True)  # a bootstrap peek plans the next chunk: it still decides
        if t == 5:
            policy.reset([1])  # row 1's episode ended mid-chunk: it decides again on the next step
        policy.predict(obs)
        held.append(policy._held.clone())
        fresh.append(policy.decides.tolist())
    assert fresh == [[True, True], [False, False], [False, False], [True, True], [False, False], [False, True],
                     [True, False]]
    for t in (1, 2, 4):  # mid-chunk: the correction chosen at the chunk's start, whatever the state is now
        torch.testing.assert_close(held[t], held[t - 1])
    assert not torch.allclose(held[3], held[2]) and not torch.allclose(held[6][0], held[5][0])
    torch.testing.assert_close(held[5][0], held[4][0])
    with pytest.raises(ValueError, match="decision"):
        ResidualConfig(decision="episode")
    with pytest.raises(PolicyError, match="needs a base"):
        ScratchPolicy(ResidualConfig(inputs=["state"], decision="chunk"), LOW, HIGH, state_dim=6)


def test_decision_every_splits_each_base_chunk_into_held_corrections():
    base = tiny_base()
    policy = ResidualPolicy(ResidualConfig(inputs=["state", "base_action"], execute_steps=6, decision="chunk",
                                           decision_every=2), LOW, HIGH, base=base)
    torch.manual_seed(0)
    torch.nn.init.normal_(policy.actor[-1].weight)
    policy.reset()
    held, fresh = [], []
    for t in range(9):
        obs = obs_batch(b=2, seed=t)
        if t == 3:
            policy.reset([1])  # row 1 restarts mid-chunk: its new chunk's first step decides
        policy.predict(obs)
        held.append(policy._held.clone())
        fresh.append(policy.decides.tolist())
    assert [f[0] for f in fresh] == [True, False, True, False, True, False, True, False, True]
    assert [f[1] for f in fresh] == [True, False, True, True, False, True, False, True, False]
    for t in (1, 3, 5, 7):  # row 0 holds each correction over two steps, then takes a fresh one
        torch.testing.assert_close(held[t][0], held[t - 1][0])
        assert not torch.allclose(held[t + 1][0], held[t][0])
    with pytest.raises(ValueError, match="decision_every"):
        ResidualConfig(decision="step", decision_every=2)
    with pytest.raises(ValueError, match="decision_every"):
        ResidualConfig(decision="chunk", decision_every=-1)


def test_residual_ppo_with_chunk_decisions_learns_a_task_with_a_known_answer(tmp_path):
    """Over a base that does nothing, a residual that decides once per base chunk (held for its 4
    steps, one semi-MDP transition each) learns to move the point to its goal."""
    from robopolicy.refine import residual_ppo

    cfg = residual_ppo.ResidualPPOConfig(
        env=EnvConfig("robopolicy/PointReach-v0"), reward="dense",
        residual=ResidualConfig(inputs=["state", "base_action"], hidden=[64, 64], log_std=-0.5, scale=1.0,
                                execute_steps=4, decision="chunk"),
        total_env_steps=16_000, num_envs=2, num_steps=256, eval_every=16_000, eval_episodes=50, eval_envs=1,
        out=str(tmp_path / "ppo"), progress=False)
    summary = residual_ppo.train(cfg, policy=residual_ppo.build_policy(cfg, base=point_teacher()), log=lambda s: None)
    assert summary["before"] <= 0.1 and summary["after"] >= 0.8
    # a second stage started from this residual starts where it ended, not at the base
    cfg.init_residual, cfg.total_env_steps, cfg.out = summary["checkpoint"], 512, str(tmp_path / "stage2")
    again = residual_ppo.train(cfg, policy=residual_ppo.build_policy(cfg, base=point_teacher()), log=lambda s: None)
    assert again["before"] == summary["after"]


def test_a_second_stage_starts_from_the_saved_residual_with_its_own_schedules(tmp_path):
    """``init_residual`` copies a saved residual's actor, critic and input statistics (the log-std
    is the new run's), refuses one of another architecture or over another base; ``final_log_std``
    lowers the exploration linearly over the run."""
    from robopolicy.refine import residual_ppo
    from robopolicy.refine.residual import init_from

    res = ResidualConfig(inputs=["state", "base_action"], hidden=[32], log_std=-0.5, scale=1.0)
    cfg = residual_ppo.ResidualPPOConfig(
        env=EnvConfig("robopolicy/PointReach-v0"), reward="dense", residual=res, total_env_steps=1024, num_envs=2,
        num_steps=128, eval_every=1024, eval_episodes=2, eval_envs=1, anneal_lr=True, final_log_std=-1.5,
        out=str(tmp_path / "one"), progress=False)
    first = residual_ppo.train(cfg, policy=residual_ppo.build_policy(cfg, base=point_teacher()), log=lambda s: None)
    saved = load_policy(first["checkpoint"])
    # four updates, the last one after 768 of 1024 steps: -0.5 + 0.75 * (-1.5 - -0.5)
    np.testing.assert_allclose(saved.log_std.detach().numpy(), [-1.25, -1.25], atol=1e-6)
    assert saved.actor[-1].weight.abs().max() > 0  # it moved off the zero residual

    fresh = residual_ppo.build_policy(cfg, base=point_teacher())
    init_from(fresh, first["checkpoint"], "init_residual")
    np.testing.assert_allclose(fresh.log_std.detach().numpy(), [-0.5, -0.5])  # this run's exploration
    obs = {"observation.state": np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)}
    for p in (fresh, saved):
        p.reset()
    torch.testing.assert_close(fresh.predict(obs), saved.predict(obs))
    torch.testing.assert_close(fresh.norm.mean, saved.norm.mean)

    cfg.init_residual = first["checkpoint"]
    other = residual_ppo.build_policy(residual_ppo.ResidualPPOConfig(
        env=cfg.env, residual=ResidualConfig(inputs=["state", "base_action"], hidden=[16])), base=point_teacher())
    with pytest.raises(PolicyError, match=r"not a residual of this architecture \(hidden \[32\] vs \[16\]\)"):
        residual_ppo.train(cfg, policy=other, log=lambda s: None)
    moved = point_teacher()
    with torch.no_grad():
        next(moved.parameters()).add_(0.01)
    with pytest.raises(PolicyError, match="learnt over another base"):
        residual_ppo.train(cfg, policy=residual_ppo.build_policy(cfg, base=moved), log=lambda s: None)
    with pytest.raises(ValueError, match="learn_std"):
        residual_ppo.ResidualPPOConfig(residual=ResidualConfig(learn_std=True), final_log_std=-2.0)


def test_residual_td3_learns_a_sparse_task_over_a_base_that_does_nothing(tmp_path):
    """Off-policy residual over a base that stays put: from the sparse success reward alone, one
    correction per 4-step base chunk moves the point to its goal; the result is one checkpoint."""
    from robopolicy.refine import residual_ppo, residual_td3

    res = ResidualConfig(inputs=["state", "base_action"], hidden=[64, 64], log_std=-1.0, scale=1.0,
                         execute_steps=4, decision="chunk", bound=1.0)
    cfg = residual_td3.ResidualTD3Config(
        env=EnvConfig("robopolicy/PointReach-v0"), reward="sparse", residual=res, total_env_steps=12_000, num_envs=2,
        learning_starts=500, updates_per_decision=2, batch_size=128, critic_hidden=[64, 64], eval_every=6_000,
        eval_episodes=50, eval_envs=1, out=str(tmp_path / "td3"), progress=False)
    base = residual_ppo.build_policy(residual_ppo.ResidualPPOConfig(env=cfg.env, residual=res), base=point_teacher())
    summary = residual_td3.train(cfg, policy=base, log=lambda s: None)
    assert summary["before"] <= 0.1 and summary["after"] >= 0.8  # 96-98% over seeds 0-2
    assert summary["updates"] >= 1.5 * (summary["decisions"] - 500)  # two updates per decision after the warm-up
    assert (tmp_path / "td3" / "critics.safetensors").is_file()
    # two evaluations: the better one's policy is kept in best/ (the earlier on a tie)
    rows = [(int(r["env_steps"]), float(r["success"])) for r in
            csv.DictReader((tmp_path / "td3" / "curve.csv").read_text().splitlines())][1:]
    assert [s for s, _ in rows] == [6_000, 12_000]
    assert summary["best"] == max(sr for _, sr in rows) >= summary["after"]
    assert summary["best_env_steps"] == next(s for s, sr in rows if sr == summary["best"])
    assert isinstance(load_policy(summary["best_checkpoint"]), ResidualPolicy)
    loaded = load_policy(summary["checkpoint"])
    assert isinstance(loaded, ResidualPolicy) and loaded.base is not None
    with pytest.raises(ValueError, match="needs a base"):
        residual_td3.build_policy(residual_td3.ResidualTD3Config(env=cfg.env))
    with pytest.raises(ValueError, match="updates_per_decision"):
        residual_td3.ResidualTD3Config(updates_per_decision=0)
    with pytest.raises(ValueError, match=r"needs residual.bound > 0"):
        residual_td3.ResidualTD3Config(residual=ResidualConfig(bound=0.0))
    # the saved residual keeps its bound, which predict() applies as training did
    assert loaded.config.bound == 1.0
    torch.testing.assert_close(loaded.bounded(torch.tensor([[5.0, -0.5]])), torch.tensor([[1.0, -0.5]]))


def test_residual_td3_critic_warmup_keeps_the_actor_at_the_base(tmp_path):
    """Before ``critic_warmup`` critic updates the actor is not trained: the policy is still exactly
    the base (zero residual) after the critics' updates."""
    from robopolicy.refine import residual_ppo, residual_td3

    res = ResidualConfig(inputs=["state", "base_action"], hidden=[32], log_std=-1.0, scale=1.0, execute_steps=4,
                         decision="chunk", bound=1.0)
    kw = dict(env=EnvConfig("robopolicy/PointReach-v0"), residual=res, total_env_steps=1_200, num_envs=1,
              learning_starts=50, updates_per_decision=1, batch_size=32, critic_hidden=[32], eval_every=1_200,
              eval_episodes=4, eval_envs=1, progress=False)
    cfg = residual_td3.ResidualTD3Config(**kw, critic_warmup=10_000, out=str(tmp_path / "warm"))
    policy = residual_ppo.build_policy(residual_ppo.ResidualPPOConfig(env=cfg.env, residual=res), base=point_teacher())
    head = [p.detach().clone() for p in policy.actor.parameters()]
    summary = residual_td3.train(cfg, policy=policy, log=lambda s: None)
    assert 0 < summary["updates"] < cfg.critic_warmup
    assert all(torch.equal(a, b) for a, b in zip(head, policy.actor.parameters()))
    assert summary["after"] == summary["before"]
    # without the warm-up the same run trains the actor
    cfg = residual_td3.ResidualTD3Config(**kw, out=str(tmp_path / "cold"))
    policy = residual_ppo.build_policy(residual_ppo.ResidualPPOConfig(env=cfg.env, residual=res), base=point_teacher())
    head = [p.detach().clone() for p in policy.actor.parameters()]
    residual_td3.train(cfg, policy=policy, log=lambda s: None)
    assert not all(torch.equal(a, b) for a, b in zip(head, policy.actor.parameters()))
    with pytest.raises(ValueError, match="critic_warmup"):
        residual_td3.ResidualTD3Config(critic_warmup=-1)


def test_curve_best_is_the_highest_refined_point_and_the_earliest_on_ties(tmp_path):
    """The starting policy's row never counts as best; ties keep the earlier point."""
    curve = Curve(tmp_path, "curve")
    curve.add(0, 0.9)
    assert curve.best() is None and not curve.is_best()
    for steps, success, best in ((10, 0.5, True), (20, 0.7, True), (30, 0.7, False), (40, 0.6, False)):
        curve.add(steps, success)
        assert curve.is_best() == best
    assert curve.best() == {"env_steps": 20, "success": 0.7}
    assert curve.best_summary() == {"best": 0.7, "best_env_steps": 20, "best_checkpoint": str(tmp_path / "best")}
    assert curve.best_summary(above=0.9)["best"] is None  # DAgger: kept only when it beats its base
