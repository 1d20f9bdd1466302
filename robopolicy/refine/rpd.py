"""RL with a behaviour-cloning term toward a teacher (RPD): distil a large policy into a compact
student and refine it with PPO.

Read top to bottom: the teacher (any checkpoint: a ``Policy`` or a residual) and a compact
student actor-critic (:class:`~robopolicy.refine.residual.ResidualPolicy` without a base, on
low-dimensional inputs) → roll out the *student* (its samples execute) while the teacher labels
every visited state → loss = PPO(student) + λ · ‖student mean − teacher action‖² in normalized
action units, λ annealed from ``bc_weight`` by ``bc_decay`` per update → evaluate → save the
student (a checkpoint ``eval`` loads through ``load_any_policy``).

The teacher runs in the same rollout as its own closed loop would (its chunk queues), so the
teacher needs the observations it was trained on (cameras for a vision teacher).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from robopolicy.envs import EnvConfig
from robopolicy.refine.common import (Curve, RewardScaler, evaluate_success, gae, make_vector_envs, ppo_loss,
                                      single_spaces)
from robopolicy.refine.residual import ENV_STATE, ResidualConfig, ResidualPolicy, load_any_policy


@dataclass
class RPDConfig:
    env: EnvConfig = field(default_factory=lambda: EnvConfig("robopolicy/ArmReach-v0"))
    base: str = ""
    """Teacher checkpoint (``--base``)."""
    student: ResidualConfig = field(default_factory=lambda: ResidualConfig(
        inputs=["state", "environment_state"], hidden=[64, 64], log_std=-1.5))
    """Compact student (no base: acts on the whole action)."""
    reward: str = "sparse"
    total_env_steps: int = 20_000
    num_envs: int = 2
    num_steps: int = 128
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    update_epochs: int = 10
    minibatches: int = 4
    target_kl: float = 0.1
    actor_lr: float = 3e-4
    critic_lr: float = 1e-3
    vf_coef: float = 0.5
    bc_weight: float = 1.0
    """λ at the start (RPD: 1)..."""
    bc_decay: float = 0.97
    """... multiplied by this after every update."""
    bc_min: float = 0.01
    max_grad_norm: float = 1.0
    reward_clip: float = 5.0
    eval_every: int = 4_000
    eval_episodes: int = 20
    eval_envs: int = 2
    eval_seed: int = 100_000
    seed: int = 0
    threads: int = 1
    out_dir: str = "outputs/refine/rpd"
    progress: bool = True


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def train(cfg: RPDConfig, teacher=None, log: Callable[[str], None] = print) -> dict:
    """Run RPD; returns a summary (teacher / student success, sizes, latency)."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    teacher = teacher if teacher is not None else load_any_policy(cfg.base)
    privileged = "environment_state" in cfg.student.inputs
    kw = {"reward": cfg.reward, "privileged": privileged}
    obs_space, act_space = single_spaces(cfg.env, **kw)
    student = ResidualPolicy(cfg.student, act_space.low, act_space.high, base=None,
                             state_dim=obs_space["observation.state"].shape[0],
                             env_state_dim=obs_space[ENV_STATE].shape[0] if privileged else 0)
    teacher_wrap = ResidualPolicy(ResidualConfig(inputs=["base_action"]), act_space.low, act_space.high, base=teacher) \
        if not isinstance(teacher, ResidualPolicy) else teacher
    out = Path(cfg.out_dir)
    curve = Curve(out, "curve")
    t0 = time.perf_counter()

    def ev(p):
        return evaluate_success(lambda o: p.predict(o)[:, 0].numpy(), p.reset, cfg.env, cfg.eval_episodes,
                                cfg.eval_envs, cfg.eval_seed, **kw)

    teacher_res, before = ev(teacher_wrap), ev(student)
    curve.add(0, before.success)
    log(f"[rpd] teacher success {teacher_res.success:.1%}; student before {before.success:.1%}")

    params = student.trainable_parameters()
    opt_a = torch.optim.Adam(params["actor"], lr=cfg.actor_lr, eps=1e-5)
    opt_c = torch.optim.Adam(params["critic"], lr=cfg.critic_lr, eps=1e-5)
    envs = make_vector_envs(cfg.env, cfg.num_envs, **kw)
    n, T = cfg.num_envs, cfg.num_steps
    a_dim, d_in = student.action_loc.shape[0], student.norm.mean.shape[0]
    x_buf, r_buf, logp_buf = torch.zeros(T, n, d_in), torch.zeros(T, n, a_dim), torch.zeros(T, n)
    teach_buf = torch.zeros(T, n, a_dim)
    rew_buf, done_buf, val_buf = torch.zeros(T, n), torch.zeros(T, n), torch.zeros(T, n)
    scaler = RewardScaler(n, cfg.gamma, cfg.reward_clip)
    obs, _ = envs.reset(seed=[cfg.seed + i for i in range(n)])
    student.reset(), teacher_wrap.reset()
    env_steps, next_eval, bc = 0, cfg.eval_every, cfg.bc_weight
    bar = tqdm(total=cfg.total_env_steps, unit="step", disable=not cfg.progress, dynamic_ncols=True)
    try:
        while env_steps < cfg.total_env_steps:
            with torch.no_grad():
                for t in range(T):
                    teacher_act = teacher_wrap.predict(obs)[:, 0]  # env units, the teacher's closed loop
                    teach_buf[t] = (teacher_act - student.action_loc) / student.action_half
                    x, _ = student.residual_input(obs)
                    student.norm.update(x)
                    x = student.norm(x)
                    dist = student.dist(x)
                    r = dist.sample()
                    x_buf[t], r_buf[t], logp_buf[t], val_buf[t] = x, r, dist.log_prob(r).sum(-1), student.value(x)
                    obs, reward, term, trunc, _info = envs.step(student.env_action(torch.zeros_like(r), r).numpy())
                    done = np.logical_or(term, trunc)
                    rew_buf[t] = torch.as_tensor(scaler(np.asarray(reward, np.float64), done), dtype=torch.float32)
                    done_buf[t] = torch.as_tensor(done, dtype=torch.float32)
                    if done.any():
                        rows = [int(i) for i in np.flatnonzero(done)]
                        teacher_wrap.reset(rows)
                env_steps += T * n
                bar.update(T * n)
                last_value = student.value(student.norm(student.residual_input(obs, peek=True)[0]))
                adv, ret = gae(rew_buf, val_buf, done_buf, last_value, cfg.gamma, cfg.gae_lambda)

            b_x, b_r, b_logp = x_buf.reshape(T * n, -1), r_buf.reshape(T * n, -1), logp_buf.reshape(-1)
            b_teach, b_ret = teach_buf.reshape(T * n, -1), ret.reshape(-1)
            b_adv = adv.reshape(-1)
            b_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-8)
            for _epoch in range(cfg.update_epochs):
                stop = False
                for idx in torch.randperm(T * n).chunk(cfg.minibatches):
                    dist = student.dist(b_x[idx])
                    pg, kl = ppo_loss(dist.log_prob(b_r[idx]).sum(-1), b_logp[idx], b_adv[idx], cfg.clip)
                    if kl.item() > cfg.target_kl:
                        stop = True
                        break
                    v_loss = 0.5 * (student.value(b_x[idx]) - b_ret[idx]).pow(2).mean()
                    # unclamped: a clamped mean outside the box would get no gradient back toward the teacher
                    bc_loss = (dist.mean - b_teach[idx]).pow(2).sum(-1).mean()
                    opt_a.zero_grad()
                    opt_c.zero_grad()
                    (pg + cfg.vf_coef * v_loss + bc * bc_loss).backward()
                    torch.nn.utils.clip_grad_norm_(params["actor"] + params["critic"], cfg.max_grad_norm)
                    opt_a.step()
                    opt_c.step()
                if stop:
                    break
            bc = max(cfg.bc_min, bc * cfg.bc_decay)
            bar.set_postfix(bc=round(bc, 3), bc_loss=round(bc_loss.item(), 4))
            if env_steps >= next_eval or env_steps >= cfg.total_env_steps:
                next_eval += cfg.eval_every
                res = ev(student)
                curve.add(env_steps, res.success, bc_weight=bc)
                log(f"[rpd] {env_steps} env steps: student success {res.success:.1%} (bc weight {bc:.3f})")
    finally:
        bar.close()
        envs.close()
    student.save(out / "final")
    latency = {name: _latency_ms(p, cfg, kw) for name, p in (("teacher", teacher_wrap), ("student", student))}
    n_teacher = count_parameters(teacher_wrap.base if teacher_wrap.base is not None else teacher_wrap)
    summary = {"teacher_success": teacher_res.success, "student_before": before.success,
               "student_after": curve.rows[-1]["success"], "teacher_params": n_teacher,
               "student_params": count_parameters(student.actor) + student.log_std.numel(),
               "latency_ms": latency, "latency_ratio": latency["teacher"] / max(latency["student"], 1e-9),
               "env_steps": env_steps, "seconds": time.perf_counter() - t0, "checkpoint": str(out / "final")}
    summary["size_ratio"] = summary["teacher_params"] / summary["student_params"]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _latency_ms(policy: ResidualPolicy, cfg: RPDConfig, kw: dict, calls: int = 30) -> float:
    """Mean ms of one batch-1 ``predict`` on a real observation, every call running the model
    (the teacher re-plans its chunk each call: the cost of one closed-loop decision)."""
    from robopolicy.refine.common import make_refine_env

    env = make_refine_env(cfg.env, **kw)
    try:
        obs, _ = env.reset(seed=cfg.eval_seed)
        batch = {k: (np.asarray(v)[None] if k != "task" else [v]) for k, v in obs.items()}
        policy.reset()
        policy.predict(batch)
        t0 = time.perf_counter()
        for _ in range(calls):
            policy.reset()
            policy.predict(batch)
        return 1000 * (time.perf_counter() - t0) / calls
    finally:
        env.close()
