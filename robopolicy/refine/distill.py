"""Teacher → camera student by on-policy relabelling ("learning by cheating").

Read top to bottom: iteration 0: the teacher drives alone and labels every state it visits with its
action chunk → the student is built from the ``model`` section of a training config (cameras,
proprio and instruction; a frozen pretrained encoder; a chunk head), its normalisation statistics
from those states and labels → then, every iteration: the student drives (the teacher's action
executes instead with probability ``beta``, decayed each iteration), the teacher labels every
visited state → the frames are encoded once (the encoder is frozen, so fine-tuning reads cached
features instead of images) → the labelled states join the aggregate → the student is trained on
it → evaluated → repeat.

The teacher reads what a robot does not have: the simulator's scene state. ``teacher: oracle`` is
the env's scripted oracle (its labels arrive in the env's info, :class:`sim_envs.wrappers.OracleLabels`;
a chunk policy's target is the oracle's own next H actions from the state, a counterfactual rollout
put back afterwards); a checkpoint is a state policy (``load_policy``) that reads
``observation.environment_state``, which the rollout envs then add
(:class:`sim_envs.wrappers.PrivilegedState`): its predicted chunk is the target. The student never
reads that state.

The rollouts, labels, batches, fine-tuning and evaluation are on-policy relabelling's
(:mod:`robopolicy.refine.dagger`); this module adds the teacher, the student and the schedule.

    robopolicy refine --method distill --teacher oracle --student-config configs/train/arm/chunk_l1.yaml \\
        --config configs/refine/distill/pushcube.yaml
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from robopolicy.config import ConfigError
from robopolicy.data.features import IMAGE_PREFIX, STATE
from robopolicy.envs import EnvConfig
from robopolicy.eval.policy_runner import to_policy_batch
from robopolicy.models.policy import STAT_NAMES, Policy, PolicyError
from robopolicy.refine.common import Curve
from robopolicy.refine.dagger import DAggerConfig, collect, evaluate, finetune, target_chunks
from robopolicy.refine.summary import write_refine_summary


@dataclass
class DistillConfig(DAggerConfig):
    env: EnvConfig = field(default_factory=lambda: EnvConfig("robopolicy/ArmPushCube-v0", {"image_size": 96}))
    teacher: str = "oracle"
    """``oracle`` (the env's scripted oracle) or a state policy checkpoint, which reads the privileged
    scene state (``observation.environment_state``) that the rollout envs add."""
    student_config: str = ""
    """A training config (e.g. ``configs/train/arm/chunk_l1.yaml``) whose ``model`` section is the
    student; its dataset-derived fields come from the env and its statistics from the teacher's first
    iteration. Not needed when ``base`` names a student checkpoint to go on training."""
    eval_env: EnvConfig | None = None
    """The env of the evaluations (e.g. the task without ``randomize``); ``None``: ``env``."""
    beta0: float = 1.0
    """Iteration 0: the teacher drives every step (its states are the student's first data)..."""
    beta_decay: float = 0.25
    """... then its action executes with probability ``beta0 * beta_decay^i`` in iteration ``i``."""
    filter: list[str] = field(default_factory=list)
    chunk_labels: str = "oracle"
    lr: float = 3e-4
    finetune_steps: int = 500
    max_seconds: float = 0.0
    """Wall-clock budget: no iteration starts once the time used plus the longest iteration so far
    would pass it (0: run every iteration). The run then ends as after its last iteration, summary
    and checkpoints written, and says how many iterations it ran."""
    feature_cache: bool = True
    """Encode each visited frame once with the frozen encoder and train on those features
    (stored as float16); ``false``: keep the images and encode them in every batch."""
    out: str = "outputs/refine/distill"

    def __post_init__(self):
        super().__post_init__()
        if self.learner not in ("auto", "policy"):
            raise ValueError("distill.learner: the student learns its actions (policy); a locator is DAgger's")
        if not self.teacher:
            raise ValueError("distill.teacher: give 'oracle' or a state policy checkpoint")
        if not self.base and not self.student_config:
            raise ValueError("distill: give student_config (a training config whose model section is the student) "
                             "or base (a student checkpoint to go on training)")
        if not self.base and self.beta0 < 1.0:
            raise ValueError("distill.beta0: a new student is built on the teacher's first rollout, so the teacher "
                             "drives all of iteration 0 (beta0 1); give base to start from a student checkpoint")
        if self.original:
            raise ValueError("distill.original: the student learns from the teacher's labels only (leave it empty)")


class PolicyTeacher:
    """A policy checkpoint as the teacher: labels every state with its predicted chunk, from the
    observation the rollout envs give (joint state, privileged scene state, instruction)."""

    def __init__(self, policy):
        if getattr(policy, "output", "chunk") != "chunk":
            raise PolicyError("distill.teacher: the teacher must predict action chunks, not waypoints")
        self.policy = policy

    def chunks(self, obs: dict, horizon: int) -> np.ndarray:
        """Vector-env observations → the teacher's chunks ``(N, horizon, A)`` (its own chunk cut to
        ``horizon``, or its last action repeated up to it)."""
        batch = to_policy_batch({k: v for k, v in obs.items() if not k.startswith(IMAGE_PREFIX)})
        chunk = np.asarray(self.policy.predict(batch), np.float32)
        if chunk.shape[1] < horizon:
            chunk = np.concatenate([chunk, np.repeat(chunk[:, -1:], horizon - chunk.shape[1], 1)], 1)
        return chunk[:, :horizon]

    def wrap_reset(self, reset: Callable[[list[int]], None]) -> Callable[[list[int]], None]:
        """``reset(rows)`` that also starts the teacher's context afresh on those rows."""
        def both(rows: list[int]) -> None:
            reset(rows)
            self.policy.reset(rows)
        return both


def make_teacher(cfg: DistillConfig) -> PolicyTeacher | None:
    """``None`` for the env's oracle, else the checkpoint's policy as a :class:`PolicyTeacher`."""
    if cfg.teacher == "oracle":
        return None
    from robopolicy.models.loading import load_policy

    if not Path(cfg.teacher).is_dir():
        raise ConfigError(f"distill.teacher: {cfg.teacher!r} is neither 'oracle' nor a checkpoint directory")
    return PolicyTeacher(load_policy(cfg.teacher))


def student_model(cfg: DistillConfig):
    """The student's ``PolicyConfig`` as the training config ``student_config`` gives it."""
    from robopolicy.config import load_config
    from robopolicy.train.trainer import TrainConfig

    train_cfg = load_config(TrainConfig, cfg.student_config)
    if train_cfg.data.features.env_state:
        raise ConfigError(f"{cfg.student_config}: data.features.env_state is set, but the student reads no "
                          f"privileged scene state (the teacher does)")
    return train_cfg.model


def _stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """Normalisation statistics of ``values`` ``(N, D)`` per dimension, as the checkpoint keeps them."""
    v = values.astype(np.float64)
    got = {"mean": v.mean(0), "std": v.std(0), "min": v.min(0), "max": v.max(0),
           "q01": np.quantile(v, 0.01, axis=0), "q99": np.quantile(v, 0.99, axis=0)}
    return {k: got[k].astype(np.float32) for k in STAT_NAMES}


def build_student(model, frames: list[dict]) -> Policy:
    """A new student for ``model`` (a ``PolicyConfig``): cameras, state size, frame size and action
    size from the first frames' observations, statistics from their states and target chunks."""
    obs = frames[0]["obs"]
    roles = [k.removeprefix(IMAGE_PREFIX) for k in obs if k.startswith(IMAGE_PREFIX)]
    cameras = list(model.cameras) or roles
    missing = [c for c in cameras if c not in roles]
    if missing:
        raise PolicyError(f"student model.cameras {missing} are not among the env's cameras {roles}")
    chunks = target_chunks(frames, model.horizon)
    state = np.stack([f["obs"][STATE] for f in frames]).astype(np.float32)
    h, w = np.asarray(obs[IMAGE_PREFIX + cameras[0]]).shape[:2] if cameras else (0, 0)
    filled = dataclasses.replace(model, cameras=cameras, action_shape=[chunks.shape[-1]],
                                 state_dim=state.shape[1] if model.use_state else 0, env_state_dim=0,
                                 frame_size=[int(h), int(w)] if cameras else [])
    if filled.relative_action:  # the head's targets are offsets from the state now
        dims = list(filled.relative_action)
        chunks[..., dims] -= state[:, None, dims]
    stats = {"action": _stats(chunks.reshape(-1, chunks.shape[-1]))}
    if filled.use_state:
        stats[STATE] = _stats(state)
    return Policy(filled, stats)


def cache_features(student: Policy, frames: list[dict], batch: int = 128) -> None:
    """Replace the camera images of ``frames`` by the frozen encoder's features ``(V, n, C)``
    (float16) under ``"features"``, which :func:`~robopolicy.refine.dagger.make_batch` reads in
    their place. Nothing happens for a trainable encoder (its features change as it trains)."""
    if student.vision is None or not student.vision.frozen:
        return
    keys = [IMAGE_PREFIX + c for c in student.cameras]
    todo = [f for f in frames if "features" not in f]
    student.eval()
    with torch.inference_mode():
        for i in range(0, len(todo), batch):
            part = todo[i:i + batch]
            tasks = [f["obs"].get("task", "") for f in part] if student.vision.needs_text else None
            per_cam = [student.encode_frames(torch.from_numpy(np.stack([f["obs"][k] for f in part])).permute(0, 3, 1, 2),
                                             tasks) for k in keys]
            feats = torch.stack(per_cam, dim=1).to(torch.float16).cpu().numpy()
            for f, x in zip(part, feats):
                f["features"] = x
                for k in keys:
                    f["obs"].pop(k, None)


def first_iteration(cfg: DistillConfig, teacher, rng: np.random.Generator, log: Callable[[str], None]):
    """``(student, frames)``: the teacher's own rollout (beta 1), labelled, and the student that
    ``base`` holds or that is built on those frames."""
    from robopolicy.models.loading import load_policy

    student = load_policy(cfg.base) if cfg.base else None
    model = None if student is not None else student_model(cfg)
    horizon = student.config.horizon if student is not None else model.horizon
    beta = cfg.beta0
    frames = collect(student if beta < 1.0 else None, cfg, beta, rng, None, teacher=teacher, horizon=horizon)
    if student is None:
        student = build_student(model, frames)
        log(f"[distill] student built from {cfg.student_config}: cameras {student.cameras}, "
            f"{sum(p.numel() for p in student.parameters() if p.requires_grad):,} trainable parameters")
    return student, frames


def train(cfg: DistillConfig, log: Callable[[str], None] = print) -> dict:
    """Distil the teacher into the camera student (see the module docstring); returns the summary and
    saves the student under ``out/final`` (and ``out/best``: the best evaluation)."""
    from tqdm.auto import tqdm

    torch.manual_seed(cfg.seed)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    rng, prng = np.random.default_rng(cfg.seed), random.Random(cfg.seed)
    teacher = make_teacher(cfg)
    out = Path(cfg.out)
    curve = Curve(out, "curve")
    t0, started = time.perf_counter(), time.time()
    seconds = dict.fromkeys(("rollout", "finetune", "eval"), 0.0)
    data, rows, env_steps, student, best, longest = [], [], 0, None, {}, 0.0  # longest: iteration's wall clock
    bar = tqdm(total=cfg.iterations * cfg.finetune_steps, unit="step", disable=not cfg.progress, dynamic_ncols=True)
    for it in range(cfg.iterations):
        if cfg.max_seconds and rows and time.perf_counter() - t0 + longest > cfg.max_seconds:
            log(f"[distill] stopping after {it} iterations: the next would pass max_seconds {cfg.max_seconds:.0f}")
            break
        beta = cfg.beta0 * cfg.beta_decay**it
        t = started_it = time.perf_counter()
        if student is None:
            student, frames = first_iteration(cfg, teacher, rng, log)
        else:
            frames = collect(student, cfg, beta, rng, None, teacher=teacher)
        if cfg.feature_cache:
            cache_features(student, frames)
        seconds["rollout"] += time.perf_counter() - t
        env_steps += len(frames)
        data += frames
        if cfg.max_states and len(data) > cfg.max_states:
            data = data[-cfg.max_states:]
        t = time.perf_counter()
        loss = finetune(student, data, cfg, prng, None, None, bar)
        seconds["finetune"] += time.perf_counter() - t
        t = time.perf_counter()
        res = evaluate(student, cfg, None, cfg.eval_env)
        seconds["eval"] += time.perf_counter() - t
        curve.add(env_steps, res.success, **res.metrics)
        if not best or res.success > best["best"]:  # every iteration counts: no base row
            student.save(out / "best")
            best = {"best": res.success, "best_env_steps": env_steps, "best_checkpoint": str(out / "best")}
        rows.append({"iteration": it, "beta": beta, "env_steps": env_steps, "aggregate_states": len(data),
                     "loss": loss, "success": res.success, "seconds": time.perf_counter() - t0})
        longest = max(longest, time.perf_counter() - started_it)
        bar.clear()
        log(f"[distill] iteration {it}: beta {beta:.3g}, {len(frames)} labelled states, aggregate {len(data)}, "
            f"loss {loss:.4f}, success {res.success:.1%} ({time.perf_counter() - t0:.0f} s)")
        bar.refresh()
    bar.close()
    student.save(out / "final")
    summary = {"teacher": cfg.teacher, "student_config": cfg.student_config, "before": None,
               "after": rows[-1]["success"], "iterations": rows, "iterations_run": len(rows), "env_steps": env_steps,
               **best, "seconds": time.perf_counter() - t0, "seconds_by_phase": seconds,
               "eval_env": dataclasses.asdict(cfg.eval_env or cfg.env), "checkpoint": str(out / "final")}
    write_refine_summary(cfg, summary, started)
    return summary
