"""Residual PPO over a frozen base policy (ResiP); without a base, PPO from scratch (same loop).

Read top to bottom: build envs and the policy → for each update: roll out ``num_steps`` steps in
``num_envs`` envs (base chunk from its queue + residual sample, every executed step; with
``residual.decision: chunk`` sampled when the base plans a chunk and held over it) → scale the
sparse reward by the running std of the return → GAE over the decisions (semi-MDP for chunk
decisions) → clipped PPO epochs over the decisions with a target-KL early stop → evaluate every
``eval_every`` env steps → save.

Shapes: ``x (T, N, D_in)`` normalized residual inputs, ``r (T, N, A)`` residual samples.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import gymnasium
import numpy as np
import torch

from robopolicy.config import ConfigError
from robopolicy.envs import EnvConfig
from robopolicy.refine.common import (Curve, EvalResult, RefineRunOptions, RewardScaler, evaluate_success, gae,
                                      make_vector_envs, ppo_loss, single_spaces)
from robopolicy.refine.residual import ENV_STATE, ResidualConfig, ResidualPolicy, init_from


@dataclass
class ResidualRunConfig(RefineRunOptions):
    """What every residual refinement loop takes (residual PPO here, residual TD3 in
    :mod:`~robopolicy.refine.residual_td3`): env, base, residual, reward, budget, evaluation."""

    env: EnvConfig = field(default_factory=lambda: EnvConfig("robopolicy/ArmReach-v0"))
    base: str = ""
    """Base policy checkpoint (frozen); empty: PPO from scratch on the whole action."""
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    reward: str = "sparse"
    """``sparse`` (success) or ``dense`` (the task's shaped reward)."""
    total_env_steps: int = 20_000
    num_envs: int = 4
    gamma: float = 0.99
    """Discount per env step (ResiP uses 0.999 for its ~1000-step episodes; ours last 100-200
    steps); a chunk decision of k steps discounts by γ^k."""
    eval_every: int = 4_000
    """Evaluate every this many env steps (and before training, and at the end)."""
    out_dir: str = "outputs/refine/residual_ppo"


@dataclass
class ResidualPPOConfig(ResidualRunConfig):
    """Residual PPO (and PPO from scratch when ``base`` is empty)."""

    num_steps: int = 128
    """Rollout length per env per update (batch = num_envs * num_steps)."""
    gae_lambda: float = 0.95
    clip: float = 0.2
    update_epochs: int = 20
    """PPO epochs over the full batch (ResiP: 50); the actor's stop early at ``target_kl``, the
    critic's run in full."""
    minibatches: int = 1
    target_kl: float = 0.1
    actor_lr: float = 3e-4
    critic_lr: float = 1e-3
    """Critic learns faster than the actor (ResiP)."""
    vf_coef: float = 0.5
    max_grad_norm: float = 1.0
    reward_clip: float = 5.0
    clipped_likelihood: bool = True
    """Score a sample whose action the box clips by the probability mass beyond the bound (see
    ``ResidualPolicy.log_prob``); False: by its Gaussian density."""
    noise_hold: int = 1
    """Hold each env's exploration noise for this many steps (1: a fresh sample every step, as
    ResiP). The likelihood stays the per-step Gaussian. Held noise (e.g. over the 8 executed steps
    of a chunk) moves the arm coherently; on the state-based PickPlace base it did worse than
    per-step noise (README, refinement table)."""

    state_noise: bool = False
    """State-dependent exploration (gSDE, Raffin et al. 2022): each env's noise is a random linear
    function of the actor's last hidden features, ``eps = W z(x) / |z(x)|`` with ``W`` drawn
    afresh every ``noise_hold`` steps (e.g. 200: once per episode). For any one state it is the
    same standard normal as per-step noise, so the likelihood is unchanged; along an episode it
    varies with the state instead of independently every step, so a correction explored near the
    grasp holds while the arm is near the grasp, and differs from the one explored while carrying."""

    init_residual: str = ""
    """A residual checkpoint to start from (e.g. an earlier run's ``best/``): its actor, critic and
    input statistics. Its architecture and its base must be this run's; the log-std is
    ``residual.log_std`` (a second stage can explore less). Empty: a fresh residual (zero output)."""
    anneal_lr: bool = False
    """Lower the actor's learning rate linearly to 0 over the run (the critic's stays), so the last
    updates settle instead of moving a policy that is already good."""
    final_log_std: float | None = None
    """Lower the exploration linearly from ``residual.log_std`` to this log-std over the run (None:
    fixed). The sampled policy pays for its noise (a 6 mm tool-point jitter costs PickPlace
    grasps), and the advantage is judged on states that noise reached."""

    replay_failures: float = 0.0
    """Probability that a training episode replays the layout (env seed) of a recent sampled
    episode that failed, instead of a fresh one (0: every layout fresh, the env's own autoreset).
    The failures left after a few stages are rare (a cube knocked at the grasp in ~2% of episodes);
    replaying their layouts shows the residual more of them. A replayed layout leaves the pool when
    drawn and comes back if it fails again. The sampled training success counts fresh layouts only."""
    replay_size: int = 256
    """The most recent failed layouts kept for replay."""

    stages: list[dict] = field(default_factory=list)
    """Later stages of one command (see :mod:`~robopolicy.refine.stages`): each a mapping of the
    settings that differ from this config, e.g. ``{total_env_steps: 600000, actor_lr: 2.0e-4}``.
    Stage k+1 starts from stage k's final residual (``init_residual``); the stages write to
    ``<out_dir>/stage1``, ``stage2``, ... and the chain's curve and summary to ``out_dir``."""

    def __post_init__(self):
        if self.noise_hold < 1:
            raise ValueError(f"noise_hold must be >= 1, got {self.noise_hold}")
        if self.final_log_std is not None and not np.isfinite(self.final_log_std):
            raise ValueError(f"final_log_std must be finite, got {self.final_log_std}")
        if not 0.0 <= self.replay_failures < 1.0:
            raise ValueError(f"replay_failures is a probability below 1, got {self.replay_failures}")
        if self.replay_size < 1:
            raise ValueError(f"replay_size must be >= 1, got {self.replay_size}")
        if self.final_log_std is not None and self.residual.learn_std:
            raise ValueError("final_log_std schedules a fixed log-std: it cannot be used with residual.learn_std")


class FailureReplay:
    """The env seeds of the next training episodes: fresh ones (from ``[10^9, 2^31)``, clear of the
    evaluation seeds), or with probability ``p`` the seed of a recent failed episode (drawn at random
    and taken out of the pool; a failure puts its seed back in). :meth:`start` and :meth:`restart`
    reset a vector env without autoreset with them and keep each env's current seed."""

    FRESH_LOW, FRESH_HIGH = 10**9, 2**31 - 1

    def __init__(self, p: float, size: int, seed: int):
        self.p = p
        self.rng = np.random.default_rng(seed)
        self.failed: deque[int] = deque(maxlen=size)
        self.row_seed: list[int] = []  # each env's current episode: its seed, and whether it is a replay
        self.row_replayed: list[bool] = []
        self.replayed = 0  # finished replayed episodes

    def draw(self) -> tuple[int, bool]:
        """``(seed, replayed)`` for one new episode."""
        if self.failed and self.rng.random() < self.p:
            i = int(self.rng.integers(len(self.failed)))
            seed = self.failed[i]
            del self.failed[i]
            return seed, True
        return int(self.rng.integers(self.FRESH_LOW, self.FRESH_HIGH)), False

    def record(self, seed: int, success: bool) -> None:
        if not success:
            self.failed.append(seed)

    def start(self, envs: gymnasium.vector.VectorEnv) -> dict:
        """Reset every env with a drawn seed; the observations."""
        self.row_seed, self.row_replayed = map(list, zip(*(self.draw() for _ in range(envs.num_envs))))
        obs, _ = envs.reset(seed=list(self.row_seed))
        return obs

    def restart(self, envs: gymnasium.vector.VectorEnv, rows: list[int], success: np.ndarray) -> dict:
        """Record the finished ``rows`` (``success``: per env), reset them with new seeds; the
        observations (the other rows' as they were)."""
        seeds: list[int | None] = [None] * envs.num_envs
        for i in rows:
            self.replayed += int(self.row_replayed[i])
            self.record(self.row_seed[i], bool(success[i]))
            self.row_seed[i], self.row_replayed[i] = self.draw()
            seeds[i] = self.row_seed[i]
        mask = np.zeros(envs.num_envs, dtype=bool)
        mask[rows] = True
        obs, _ = envs.reset(seed=seeds, options={"reset_mask": mask})
        return obs


@torch.no_grad()
def state_noise(policy: ResidualPolicy, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Standard-normal exploration draws ``(N, A)`` for normalized inputs ``x (N, D_in)`` as a fixed
    linear function ``weights (N, H, A)`` of the actor's unit-norm last hidden features
    (``state_noise``): for one state and random weights each column is N(0, 1)."""
    z = policy.actor[:-1](x)
    z = z / z.norm(dim=1, keepdim=True).clamp_min(1e-8)
    return torch.einsum("nh,nha->na", z, weights)


def env_kwargs(cfg: ResidualRunConfig) -> dict:
    return {"reward": cfg.reward, "privileged": "environment_state" in cfg.residual.inputs}


def build_policy(cfg: ResidualRunConfig, base=None) -> ResidualPolicy:
    """The residual (over ``base`` or ``cfg.base``) sized for ``cfg.env``."""
    from robopolicy.refine.residual import load_any_policy

    obs_space, act_space = single_spaces(cfg.env, **env_kwargs(cfg))
    if base is None and cfg.base:
        base = load_any_policy(cfg.base)
        if isinstance(base, ResidualPolicy):
            raise ValueError(f"--base {cfg.base} is already a residual checkpoint; give a plain policy checkpoint")
    state_dim = obs_space["observation.state"].shape[0] if "observation.state" in obs_space.spaces else 0
    env_dim = obs_space[ENV_STATE].shape[0] if ENV_STATE in obs_space.spaces else 0
    return ResidualPolicy(cfg.residual, act_space.low, act_space.high, base=base, state_dim=state_dim,
                          env_state_dim=env_dim)


def evaluate(policy: ResidualPolicy, cfg: ResidualRunConfig) -> EvalResult:
    """Deterministic success rate on the fixed evaluation seeds."""
    def act(obs):
        return policy.predict(obs)[:, 0].numpy()
    return evaluate_success(act, policy.reset, cfg.env, cfg.eval_episodes, cfg.eval_envs, cfg.eval_seed,
                            **env_kwargs(cfg))


def periodic_evaluation(policy: ResidualPolicy, cfg: ResidualRunConfig, curve: Curve, env_steps: int, t0: float,
                        window_episodes: int, window_successes: int, log: Callable[[str], None], **extra) -> None:
    """Evaluate during training: a curve point, a log line, and the policy saved to ``best/`` when this
    evaluation is the best so far (:meth:`Curve.best`). Beside the deterministic success, the
    sampled policy's success on the training episodes that ended since the last evaluation shows
    whether the loop improves its own (noisy) objective. ``extra``: more curve columns."""
    elapsed = policy.elapsed.copy()
    res = evaluate(policy, cfg)
    train_sr = window_successes / max(window_episodes, 1)
    curve.add(env_steps, res.success, seconds=time.perf_counter() - t0, train_success=train_sr,
              train_episodes=window_episodes, **extra)
    more = "".join(f"; {v} {k}" for k, v in extra.items())
    log(f"[refine] {env_steps} env steps: success {res.success:.1%} "
        f"(sampled, training: {train_sr:.1%} of {window_episodes}{more})")
    if curve.is_best():
        policy.save(Path(cfg.out_dir) / "best")
    # evaluation used the policy's queues: the training rows plan their chunks afresh (a residual
    # TD3 row's open transition ends at that new decision), but their episodes go on: keep their step counts
    policy.reset()
    policy.elapsed = elapsed


def train(cfg: ResidualPPOConfig, policy: ResidualPolicy | None = None, log: Callable[[str], None] = print) -> dict:
    """Run residual PPO; returns a summary (before / after success, steps to 80%, paths)."""
    from tqdm import tqdm

    if cfg.stages:
        raise ConfigError("a config with stages runs through robopolicy.refine.stages.train (robopolicy refine "
                          "does), which trains each stage with this function")

    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    policy = policy or build_policy(cfg)
    if cfg.init_residual:
        init_from(policy, cfg.init_residual, "init_residual")
    params = policy.trainable_parameters()
    opt_actor = torch.optim.Adam(params["actor"], lr=cfg.actor_lr, eps=1e-5)
    opt_critic = torch.optim.Adam(params["critic"], lr=cfg.critic_lr, eps=1e-5)
    start_log_std = policy.log_std.detach().clone()
    curve = Curve(out, "curve")
    t0 = time.perf_counter()

    before = evaluate(policy, cfg)
    curve.add(0, before.success, seconds=time.perf_counter() - t0)
    log(f"[refine] before: success {before.success:.1%} ({before.episodes} episodes)")

    replay = FailureReplay(cfg.replay_failures, cfg.replay_size, cfg.seed) if cfg.replay_failures > 0 else None
    envs = make_vector_envs(cfg.env, cfg.num_envs, autoreset=replay is None, **env_kwargs(cfg))
    n, T, a_dim = cfg.num_envs, cfg.num_steps, policy.action_loc.shape[0]
    d_in = policy.norm.mean.shape[0]
    x_buf = torch.zeros(T, n, d_in)
    r_buf, logp_buf, base_buf = torch.zeros(T, n, a_dim), torch.zeros(T, n), torch.zeros(T, n, a_dim)
    rew_buf, done_buf, val_buf = torch.zeros(T, n), torch.zeros(T, n), torch.zeros(T, n)
    dec_buf = torch.zeros(T, n)  # 1 where the residual decided (every step, or each chunk's first)
    scaler = RewardScaler(n, cfg.gamma, cfg.reward_clip)
    noise = torch.zeros(n, a_dim)
    weights = torch.zeros(n, policy.actor[-1].in_features, a_dim)  # state_noise: each env's W
    since = np.zeros(n, dtype=np.int64)  # steps since each env's noise was drawn (0: draw now)
    if replay is None:
        obs, _ = envs.reset(seed=[cfg.seed + i for i in range(n)])
    else:  # the loop resets finished envs itself, with the layouts replay draws
        obs = replay.start(envs)
    policy.reset()
    env_steps, next_eval, episodes = 0, cfg.eval_every, 0
    window_episodes, window_successes = 0, 0  # sampled training episodes since the last evaluation
    bar = tqdm(total=cfg.total_env_steps, unit="step", disable=not cfg.progress, dynamic_ncols=True)
    try:
        while env_steps < cfg.total_env_steps:
            done_frac = env_steps / cfg.total_env_steps
            if cfg.anneal_lr:
                opt_actor.param_groups[0]["lr"] = cfg.actor_lr * (1.0 - done_frac)
            if cfg.final_log_std is not None:
                policy.log_std.data.copy_(start_log_std + done_frac * (cfg.final_log_std - start_log_std))
            # ---- rollout: the base's queued action + a sampled residual on every step
            with torch.no_grad():
                for t in range(T):
                    x, base_norm = policy.residual_input(obs)
                    policy.norm.update(x)
                    x = policy.norm(x)
                    dist = policy.dist(x)
                    fresh = torch.as_tensor(since % cfg.noise_hold == 0)
                    if cfg.state_noise:
                        weights[fresh] = torch.randn(int(fresh.sum()), *weights.shape[1:])
                        noise = state_noise(policy, x, weights)
                    else:
                        noise[fresh] = torch.randn(int(fresh.sum()), a_dim)
                    since += 1
                    r = policy.hold(dist.sample(noise))  # decision: chunk — held between decisions
                    action = policy.env_action(base_norm, r)
                    x_buf[t], r_buf[t], base_buf[t], dec_buf[t] = x, r, base_norm, policy.decides.float()
                    logp_buf[t] = policy.log_prob(dist, r, base_norm, clipped=cfg.clipped_likelihood)
                    val_buf[t] = policy.value(x)
                    obs, reward, term, trunc, info = envs.step(action.numpy())
                    done = np.logical_or(term, trunc)
                    rew_buf[t] = torch.as_tensor(scaler(np.asarray(reward, np.float64), done), dtype=torch.float32)
                    done_buf[t] = torch.as_tensor(done, dtype=torch.float32)
                    if done.any():
                        rows = [int(i) for i in np.flatnonzero(done)]
                        policy.reset(rows)
                        since[rows] = 0
                        episodes += len(rows)
                        # the training success counts fresh layouts only
                        ended = info["final_info"] if replay is None else info
                        won = np.asarray(ended.get("is_success", np.zeros(n)), dtype=bool)
                        fresh = [i for i in rows if replay is None or not replay.row_replayed[i]]
                        window_episodes += len(fresh)
                        window_successes += int(won[fresh].sum())
                        if replay is not None:
                            obs = replay.restart(envs, rows, won)
                env_steps += T * n
                bar.update(T * n)
                x_last, _ = policy.residual_input(obs, peek=True)  # the next step acts on these queued actions
                last_value = policy.value(policy.norm(x_last))
                adv, ret = gae(rew_buf, val_buf, done_buf, last_value, cfg.gamma, cfg.gae_lambda, dec_buf)

            # ---- PPO on the decisions: full-batch (or minibatch) epochs, early stop at target KL
            keep = dec_buf.reshape(-1) > 0
            b_x, b_r, b_logp = x_buf.reshape(T * n, -1)[keep], r_buf.reshape(T * n, -1)[keep], logp_buf.reshape(-1)[keep]
            b_base = base_buf.reshape(T * n, -1)[keep]
            b_adv, b_ret = adv.reshape(-1)[keep], ret.reshape(-1)[keep]
            b_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-8)
            m = len(b_adv)
            stats = {}
            actor_on, actor_epochs = True, 0
            for epoch in range(cfg.update_epochs):
                for idx in torch.randperm(m).chunk(cfg.minibatches):
                    v_loss = 0.5 * (policy.value(b_x[idx]) - b_ret[idx]).pow(2).mean()
                    loss = cfg.vf_coef * v_loss
                    if actor_on:
                        dist = policy.dist(b_x[idx])
                        new_logp = policy.log_prob(dist, b_r[idx], b_base[idx], clipped=cfg.clipped_likelihood)
                        pg_loss, kl = ppo_loss(new_logp, b_logp[idx], b_adv[idx], cfg.clip)
                        if kl.item() > cfg.target_kl:
                            # the KL stop ends the actor's epochs only: the critic keeps fitting the
                            # returns (cut with the actor, it fit them in as few as 3 epochs)
                            actor_on = False
                        else:
                            loss = loss + pg_loss
                            stats.update(pg_loss=pg_loss.item(), kl=kl.item())
                            actor_epochs = epoch + 1
                    opt_actor.zero_grad()
                    opt_critic.zero_grad()
                    loss.backward()
                    # clipped apart: a large critic gradient must not shrink the actor's step
                    torch.nn.utils.clip_grad_norm_(params["actor"], cfg.max_grad_norm)
                    torch.nn.utils.clip_grad_norm_(params["critic"], cfg.max_grad_norm)
                    if actor_on:
                        opt_actor.step()
                    opt_critic.step()
                    stats.update(v_loss=v_loss.item(), epochs=actor_epochs)
            bar.set_postfix(ep=episodes, **({"replayed": replay.replayed} if replay else {}),
                            train_sr=f"{window_successes / max(window_episodes, 1):.2f}",
                            **{k: round(v, 3) for k, v in stats.items()})

            if env_steps >= next_eval or env_steps >= cfg.total_env_steps:
                next_eval += cfg.eval_every
                periodic_evaluation(policy, cfg, curve, env_steps, t0, window_episodes, window_successes, log)
                window_episodes, window_successes = 0, 0
    finally:
        bar.close()
        envs.close()
    after = EvalResult(curve.rows[-1]["success"], cfg.eval_episodes, 0)
    policy.save(out / "final")
    summary = {"before": before.success, "after": after.success, "env_steps": env_steps,
               "steps_to_80": curve.steps_to(0.8), "seconds": time.perf_counter() - t0,
               **({"replayed_episodes": replay.replayed, "episodes": episodes} if replay else {}),
               "checkpoint": str(out / "final"), **curve.best_summary(),
               "curve_csv": str(out / "curve.csv"), "curve_png": str(out / "curve.png")}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary

