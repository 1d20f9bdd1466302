"""RL with a behaviour-cloning term toward a teacher (RPD): distil a large policy into a compact
student and refine it with PPO.

Read top to bottom: the teacher (any checkpoint: a ``Policy`` or a residual) and a compact
student actor-critic (:class:`~robopolicy.refine.scratch.ScratchPolicy`, on
low-dimensional inputs) → roll out the *student* (its samples execute) while the teacher labels
every visited state → loss = PPO(student) + λ · ‖student mean − teacher action‖² in normalized
action units, λ annealed from ``bc_weight`` by ``bc_decay`` per update → evaluate → save the
student (a checkpoint ``eval`` loads through ``load_policy``), and the student of the best
evaluation in ``best/``.

A per-step student learns the teacher's closed-loop action (the teacher's chunk queues run in
the same rollout). A chunk student (``student.chunk`` = k > 1) decides every k steps; PPO then
treats each chunk as one transition (a semi-MDP: its discounted reward sum, γ^k to the next
decision; ``robopolicy.rl.gae`` over the decision mask, as for residual PPO's chunk decisions) and
the BC target on every visited state is the first k actions of a fresh teacher
chunk from that state. Either way the teacher needs the observations it was trained on (cameras
for a vision teacher).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from hardware.control.chunking import ChunkExecutor
from robopolicy.data.features import ENV_STATE
from robopolicy.envs import EnvConfig
from robopolicy.eval.envs import make_task_envs, single_spaces
from robopolicy.eval.episodes import evaluate_success
from robopolicy.models import load_policy
from robopolicy.models.policy import PolicyError
from robopolicy.refine.common import Curve, RefineRunOptions
from robopolicy.refine.residual import ActorCriticPolicy, ResidualConfig, ResidualPolicy, init_from
from robopolicy.refine.scratch import ScratchPolicy
from robopolicy.refine.summary import write_refine_summary
from robopolicy.rl import PPOSettings, RewardScaler, gae, ppo_update
from robopolicy.rl.ppo import Batch, normalize_advantages


@dataclass
class RPDConfig(RefineRunOptions):
    env: EnvConfig = field(default_factory=lambda: EnvConfig("robopolicy/ArmReach-v0"))
    base: str = ""
    """Teacher checkpoint (``--base``)."""
    student: ResidualConfig = field(default_factory=lambda: ResidualConfig(
        inputs=["state", "environment_state"], hidden=[64, 64], log_std=-1.5))
    """Compact student (no base: acts on the whole action)."""
    init_student: str = ""
    """A student checkpoint to start from (e.g. an earlier run's ``best/``): its actor, critic
    and input statistics; its architecture must be ``student``'s, and the log-std is
    ``student.log_std``. Empty: a fresh student."""
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
    kl_stop: str = "update"
    """What a minibatch's KL beyond ``target_kl`` ends (:attr:`robopolicy.rl.PPOSettings.kl_stop`):
    ``update``, the whole update from that minibatch on (RPD's), or ``actor``, the actor's epochs
    only (residual PPO's)."""
    actor_lr: float = 3e-4
    critic_lr: float = 1e-3
    vf_coef: float = 0.5
    bc_weight: float = 1.0
    """λ at the start (RPD: 1)..."""
    bc_decay: float = 0.97
    """... multiplied by this after every update."""
    bc_min: float = 0.01
    bc_buffer: int = 0
    """The BC term samples from the last this-many visited states with their teacher labels
    (DAgger's aggregation; 0: this rollout's states only, as RPD)."""
    pg_coef: float = 1.0
    """Weight of the PPO term (1: RPD)."""
    dual_clip: float | None = 3.0
    """Dual-clip PPO's bound (see ``robopolicy.rl.ppo_loss``): the BC term moves the mean by many stds
    within an update, and without the bound the negative-advantage samples whose ratio then
    explodes dominate the step; ``None``: plain clipped PPO."""
    ppo_actor_lr: float | None = None
    """The actor's learning rate once the PPO term has joined (``None``: ``actor_lr`` throughout)."""
    bc_warmup_steps: int = 0
    """Env steps with the BC term alone before the PPO term joins: a student far from the teacher
    sees no reward under a sparse task, and the PPO term's normalized advantages are then only the
    critic's noise, which a small action std turns into large steps of the mean."""
    clipped_likelihood: bool = True
    """Score a sample beyond the action box by the probability mass beyond it (see
    ``ResidualPolicy.log_prob``); False: by its Gaussian density, which pushes the mean of any
    action the task wants at a bound outward without limit."""
    max_grad_norm: float = 1.0
    reward_clip: float = 5.0
    eval_every: int = 4_000
    out: str = "outputs/refine/rpd"


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class BCTerm:
    """The BC term as the PPO update's auxiliary loss: ``weight`` · mean squared error of the
    student's (unclamped) mean to the teacher's labels, on samples drawn apart from the decisions
    (every visited state is a BC sample, not only the decision states)."""

    def __init__(self, student: ScratchPolicy, x: torch.Tensor, y: torch.Tensor, per_batch: int, minibatches: int,
                 weight: float):
        self.student, self.x, self.y, self.weight = student, x, y, weight
        self.per_batch, self.minibatches = per_batch, minibatches

    def draw(self) -> tuple[torch.Tensor, ...]:
        return torch.randperm(len(self.x))[:self.per_batch].chunk(self.minibatches)

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        # unclamped: a clamped mean outside the box would get no gradient back toward the teacher
        return _bc_loss(self.student.actor(self.x[idx]), self.y[idx], self.student.config.chunk)


@dataclass
class Run:
    """What the RPD loop carries from update to update."""

    student: ScratchPolicy
    teacher: ActorCriticPolicy
    optimizers: list
    scaler: RewardScaler
    executor: ChunkExecutor
    bc: float
    ppo_on: bool = False
    bc_loss: float = float("nan")
    train_eps: list[bool] = field(default_factory=list)
    buf_x: torch.Tensor | None = None
    buf_y: torch.Tensor | None = None


def build(cfg: RPDConfig, teacher) -> tuple[ScratchPolicy, ActorCriticPolicy, dict]:
    """The student, the teacher as a closed-loop actor (its chunks executed), the env kwargs."""
    teacher = teacher if teacher is not None else load_policy(cfg.base)
    if "time" in cfg.student.inputs:
        # the loop queries the student on every step for the BC labels, not only when it decides,
        # so the student's own step count would run ahead of the episode
        raise ValueError("student.inputs: 'time' is not supported by RPD yet (residual PPO and PPO take it)")
    privileged = "environment_state" in cfg.student.inputs
    kw = {"reward": cfg.reward, "privileged": privileged}
    obs_space, act_space = single_spaces(cfg.env, **kw)
    student = ScratchPolicy(cfg.student, act_space.low, act_space.high,
                            state_dim=obs_space["observation.state"].shape[0],
                            env_state_dim=obs_space[ENV_STATE].shape[0] if privileged else 0)
    if cfg.init_student:
        init_from(student, cfg.init_student, "init_student")
    teacher_wrap = ResidualPolicy(ResidualConfig(inputs=["base_action"]), act_space.low, act_space.high, base=teacher) \
        if not isinstance(teacher, ActorCriticPolicy) else teacher
    k = student.config.chunk
    if k > 1 and (teacher_wrap.base is None or teacher_wrap is teacher or teacher.output != "chunk"
                  or teacher.horizon < k):
        raise PolicyError(f"a chunk student (student.chunk={k}) learns a teacher's chunks: the teacher must be a "
                          f"chunk policy checkpoint predicting at least {k} actions")
    return student, teacher_wrap, kw


def rollout(run: Run, envs, obs: dict, cfg: RPDConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """``num_steps`` steps of the sampled student (its chunks executed whole) while the teacher
    labels every visited state; the next observation and the ``(T, N)`` buffers (the student's
    sample, log-prob and value where it decided; ``bc_x`` raw inputs and ``bc_y`` labels of every state)."""
    student, k, n, T = run.student, run.student.config.chunk, envs.num_envs, cfg.num_steps
    width = student.ac.gaussian.shape[0]
    buf = {"x": torch.zeros(T, n, student.norm.mean.shape[0]), "r": torch.zeros(T, n, width),
           **{key: torch.zeros(T, n) for key in ("logp", "val", "rew", "done", "dec")}}
    bc_x, bc_y = [], []
    for t in range(T):
        x_raw = student.residual_input(obs)[0]
        student.norm.update(x_raw)
        x = student.norm(x_raw)
        bc_x.append(x_raw)
        bc_y.append(_teacher_label(run.teacher, obs, k, student))
        need = np.flatnonzero(run.executor.needs()).tolist()
        if need:
            dist = student.dist(x[need])
            r = dist.sample()
            buf["x"][t, need], buf["r"][t, need], buf["dec"][t, need] = x[need], r, 1.0
            buf["logp"][t, need] = student.log_prob(dist, r, clipped=cfg.clipped_likelihood)
            buf["val"][t, need] = student.value(x[need])
            acts = student.env_action(torch.zeros(len(need), student.action_loc.shape[0]), r)
            run.executor.add(need, acts.reshape(len(need), k, -1).numpy())
        obs, reward, term, trunc, info = envs.step(run.executor.next())
        done = np.logical_or(term, trunc)
        buf["rew"][t] = torch.as_tensor(run.scaler(np.asarray(reward, np.float64), done), dtype=torch.float32)
        buf["done"][t] = torch.as_tensor(done, dtype=torch.float32)
        if done.any():  # the sampled (exploring) student's episodes, for the training success
            won = np.asarray(info.get("final_info", {}).get("is_success", np.zeros(n)))
            run.train_eps.extend(bool(won[i]) for i in np.flatnonzero(done))
            rows = [int(i) for i in np.flatnonzero(done)]
            run.executor.reset(rows)
            run.teacher.base.reset(rows) if k > 1 else run.teacher.reset(rows)
    # A chunk still running at the rollout's end is cut there and bootstrapped from the value of
    # the state reached; semi-MDP GAE over the decisions (robopolicy.rl.gae).
    last_value = student.value(student.norm(student.residual_input(obs, peek=True)[0]))
    buf["adv"], buf["ret"] = gae(buf["rew"], buf["val"], buf["done"], last_value, cfg.gamma, cfg.gae_lambda,
                                 buf["dec"])
    buf["bc_x"], buf["bc_y"] = torch.cat(bc_x), torch.cat(bc_y)
    return obs, buf


def update(run: Run, buf: dict[str, torch.Tensor], env_steps: int, cfg: RPDConfig) -> bool:
    """PPO (KL stop as ``cfg.kl_stop``) plus the BC term on one rollout; False when the rollout
    holds no decision (nothing to update)."""
    keep = buf["dec"].reshape(-1) > 0
    if not keep.any():
        return False
    student = run.student
    flat = {key: buf[key].reshape(keep.shape[0], *buf[key].shape[2:])[keep]
            for key in ("x", "r", "logp", "adv", "ret")}
    bc_x, bc_y = buf["bc_x"], buf["bc_y"]
    per_batch = len(bc_x)
    if cfg.bc_buffer > 0:
        run.buf_x = bc_x if run.buf_x is None else torch.cat([run.buf_x, bc_x])[-cfg.bc_buffer:]
        run.buf_y = bc_y if run.buf_y is None else torch.cat([run.buf_y, bc_y])[-cfg.bc_buffer:]
        bc_x, bc_y = run.buf_x, run.buf_y
    bc_x = student.norm(bc_x)  # raw inputs, standardized with the statistics of now
    joined = env_steps > cfg.bc_warmup_steps  # PPO's term is on from here
    if joined and not run.ppo_on:
        # A fresh actor optimizer: Adam's second moments, adapted to the BC term's small
        # gradients, would otherwise turn the PPO term's far larger ones into steps many
        # times the learning rate until they catch up (hundreds of steps).
        run.ppo_on = True
        lr = cfg.actor_lr if cfg.ppo_actor_lr is None else cfg.ppo_actor_lr
        run.optimizers[0] = torch.optim.Adam(student.trainable_parameters()["actor"], lr=lr, eps=1e-5)
    settings = PPOSettings(epochs=cfg.update_epochs, minibatches=cfg.minibatches, clip=cfg.clip,
                           target_kl=cfg.target_kl, kl_stop=cfg.kl_stop, vf_coef=cfg.vf_coef,
                           max_grad_norm=cfg.max_grad_norm, pg_coef=cfg.pg_coef if joined else 0.0,
                           dual_clip=cfg.dual_clip)

    def logp_of(idx):
        return student.log_prob(student.dist(flat["x"][idx]), flat["r"][idx], clipped=cfg.clipped_likelihood)
    stats = ppo_update(logp_of, lambda idx: student.value(flat["x"][idx]),
                       Batch(flat["logp"], normalize_advantages(flat["adv"]), flat["ret"]), tuple(run.optimizers),
                       student.trainable_parameters(), settings,
                       aux=BCTerm(student, bc_x, bc_y, per_batch, cfg.minibatches, run.bc))
    run.bc_loss = stats.get("aux_loss", run.bc_loss)
    if joined:  # the BC weight anneals once PPO has joined
        run.bc = max(cfg.bc_min, run.bc * cfg.bc_decay)
    return True


def train(cfg: RPDConfig, teacher=None, log: Callable[[str], None] = print) -> dict:
    """Run RPD; returns a summary (teacher / student success, sizes, latency)."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    started = time.time()
    student, teacher_wrap, kw = build(cfg, teacher)
    out = Path(cfg.out)
    curve = Curve(out, "curve")
    t0 = time.perf_counter()

    def ev(p):
        act, reset = _stepper(p)
        return evaluate_success(act, reset, cfg.env, cfg.eval_episodes, cfg.eval_envs, cfg.eval_seed, **kw)

    teacher_res, before = ev(teacher_wrap), ev(student)
    curve.add(0, before.success)
    log(f"[rpd] teacher success {teacher_res.success:.1%}; student before {before.success:.1%}")
    params = student.trainable_parameters()
    run = Run(student, teacher_wrap, [torch.optim.Adam(params["actor"], lr=cfg.actor_lr, eps=1e-5),
                                      torch.optim.Adam(params["critic"], lr=cfg.critic_lr, eps=1e-5)],
              RewardScaler(cfg.num_envs, cfg.gamma, cfg.reward_clip), ChunkExecutor("chunk", n_envs=cfg.num_envs),
              cfg.bc_weight)
    envs = make_task_envs(cfg.env, cfg.num_envs, **kw)
    obs, _ = envs.reset(seed=[cfg.seed + i for i in range(cfg.num_envs)])
    student.reset(), teacher_wrap.reset()
    env_steps, next_eval = 0, cfg.eval_every
    bar = tqdm(total=cfg.total_env_steps, unit="step", disable=not cfg.progress, dynamic_ncols=True)
    try:
        while env_steps < cfg.total_env_steps:
            with torch.no_grad():
                obs, buf = rollout(run, envs, obs, cfg)
            env_steps += cfg.num_steps * cfg.num_envs
            bar.update(cfg.num_steps * cfg.num_envs)
            if not update(run, buf, env_steps, cfg):
                continue
            bar.set_postfix(bc=round(run.bc, 3), bc_loss=round(run.bc_loss, 4),
                            train_sr=round(float(np.mean(run.train_eps)), 2) if run.train_eps else None)
            if env_steps >= next_eval or env_steps >= cfg.total_env_steps:
                next_eval += cfg.eval_every
                res = ev(student)
                train_sr = float(np.mean(run.train_eps)) if run.train_eps else float("nan")
                run.train_eps.clear()
                curve.add(env_steps, res.success, bc_weight=run.bc, bc_loss=run.bc_loss, train_success=train_sr)
                if curve.is_best():
                    student.save(out / "best")
                log(f"[rpd] {env_steps} env steps: student success {res.success:.1%}, sampled {train_sr:.1%} in "
                    f"training (bc weight {run.bc:.3f}, bc loss {run.bc_loss:.4f})")
    finally:
        bar.close()
        envs.close()
    student.save(out / "final")
    summary = _summary(cfg, student, teacher_wrap, teacher_res.success, before.success, curve, kw)
    summary.update(env_steps=env_steps, seconds=time.perf_counter() - t0)
    write_refine_summary(cfg, summary, started)
    return summary


def _summary(cfg: RPDConfig, student: ScratchPolicy, teacher: ActorCriticPolicy, teacher_success: float,
             before: float, curve: Curve, kw: dict) -> dict:
    """Teacher / student success, sizes and latency."""
    best = curve.best_summary()
    latency = {name: _latency_ms(p, cfg, kw) for name, p in (("teacher", teacher), ("student", student))}
    n_teacher = count_parameters(teacher.base if teacher.base is not None else teacher)
    n_student = count_parameters(student.actor) + student.log_std.numel()
    return {"teacher_success": teacher_success, "student_before": before,
            "student_after": curve.rows[-1]["success"], "teacher_params": n_teacher,
            "student_best": best.pop("best"), **best, "student_params": n_student,
            "latency_ms": latency, "latency_ratio": latency["teacher"] / max(latency["student"], 1e-9),
            "checkpoint": str(Path(cfg.out) / "final"), "size_ratio": n_teacher / n_student}


def _stepper(policy) -> tuple[Callable[[dict], np.ndarray], Callable[[list[int] | None], None]]:
    """``(act, reset)`` for :func:`evaluate_success`: one action per env step. A chunk policy's
    chunk is executed in full before it is asked again (the chunk executor ``robopolicy eval`` runs)."""
    if policy.horizon == 1:
        return (lambda o: policy.predict(o)[:, 0].numpy()), policy.reset
    executor = ChunkExecutor("chunk")

    def act(obs):
        executor.resize(len(np.asarray(obs["observation.state"])))
        need = np.flatnonzero(executor.needs())
        if len(need):
            executor.add(need, policy.predict(obs).numpy()[need])
        return executor.next()

    def reset(rows=None):
        executor.reset(rows)
        policy.reset(rows)

    return act, reset


def _teacher_label(teacher: ActorCriticPolicy, obs, k: int, student: ScratchPolicy) -> torch.Tensor:
    """The teacher's action(s) for this state in the student's normalized units, ``(B, k * A)``.

    A per-step student (k = 1) learns the teacher's closed-loop action (its chunk queue). A chunk
    student learns a fresh teacher chunk's first k actions: what the teacher would execute from
    this state on; it is a function of the state, while the queued action also depends on when
    the chunk was planned."""
    if k == 1:
        act = teacher.predict(obs)[:, 0]
    else:
        act = teacher.base.predict(obs)[:, :k]
    return ((act - student.action_loc) / student.action_half).reshape(act.shape[0], -1)


def _bc_loss(mean: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """Squared error summed over action dims, averaged over states and chunk steps."""
    return (mean - target).pow(2).reshape(mean.shape[0], k, -1).sum(-1).mean()


def _latency_ms(policy: ActorCriticPolicy, cfg: RPDConfig, kw: dict, calls: int = 30) -> float:
    """Mean ms of one batch-1 ``predict`` on a real observation, every call running the model
    (the teacher re-plans its chunk each call: the cost of one closed-loop decision)."""
    from robopolicy.eval.envs import make_task_env

    env = make_task_env(cfg.env, **kw)
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
