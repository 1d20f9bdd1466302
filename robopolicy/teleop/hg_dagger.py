"""HG-DAgger (Kelly et al. 2019): the policy drives, an operator takes over when it heads for
failure, and only the operator's interventions are labelled and learned from.

Read top to bottom: for each iteration: roll out the current policy with a
:class:`~hardware.teleop.SimOperator` watching each env (the oracle behind a model of a person:
reaction delay, noise, lapses, its take-over rule) → the states where the operator drove are
labelled with the operator's own action (``label: operator``, what a person gives) or the
oracle's clean one (``label: oracle``) → DAgger's label filter drops the unreliable ones → they
join the aggregate → fine-tune with the original data mixed into every batch
(``original``, ``original_fraction``) → evaluate → repeat. A chunk policy's target for an
intervention state is the operator's next ``H`` actions within the same intervention, padded.

Unlike DAgger's oracle relabelling, which labels every visited state, the labels here are only
the interventions: the summary reports ``labels`` beside the gain, the comparison that matters.
Fine-tuning, evaluation and the original-data mix are DAgger's own
(:mod:`robopolicy.refine.dagger`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from hardware.teleop.sim_operator import SimOperator
from robopolicy.eval.envs import make_task_envs
from robopolicy.refine import dagger
from robopolicy.refine.common import Curve
from robopolicy.refine.ray_rollouts import hg_dagger_rollout, rollout_pool
from robopolicy.refine.summary import write_refine_summary


@dataclass
class HGDAggerConfig(dagger.DAggerConfig):
    operator: dict = field(default_factory=dict)
    """SimOperator settings (reaction, noise, lapse_rate, lapse_s, disagree, patience, min_progress,
    stall_steps, min_drive_s, max_drive_s); the defaults model an attentive person."""
    label: str = "operator"
    """What an intervention state learns: ``operator`` (the action the operator executed, noise and
    all, as a person's would be) or ``oracle`` (the clean action behind it)."""
    control_dt: float = 0.1
    """Seconds per env step, for the operator's reaction delay and lapses."""
    filter: list[str] = field(default_factory=list)
    out: str = "outputs/refine/hg_dagger"

    def __post_init__(self):
        super().__post_init__()
        if self.label not in ("operator", "oracle"):
            raise ValueError(f"hg-dagger.label: {self.label!r} is not 'operator' or 'oracle'")
        if not self.control_dt > 0:
            raise ValueError(f"hg-dagger.control_dt must be > 0, got {self.control_dt}")


def collect(policy, cfg: HGDAggerConfig, rng: np.random.Generator, ends: list | None = None) -> tuple[list[dict], dict]:
    """Roll out the policy under the operators for ``steps_per_iteration`` steps; returns the
    intervention states (labelled, with DAgger's frame fields) and counts. ``ends``: as
    :func:`robopolicy.refine.dagger.collect`'s."""
    act, reset = dagger.policy_actor(policy, cfg.steps_per_chunk, False)
    n = cfg.num_envs
    envs = make_task_envs(cfg.env, n, reward="dense", oracle=True, replan=cfg.replan)
    ops = [SimOperator(None, cfg.control_dt, int(rng.integers(1 << 30)), action_space=envs.single_action_space,
                       **cfg.operator) for _ in range(n)]
    episodes: list[list[dict]] = [[] for _ in range(n)]
    frames: list[dict] = []
    counts = {"env_steps": 0, "takeovers": 0, "lapses": 0, "episodes": 0}
    try:
        obs, info = envs.reset(seed=[int(rng.integers(1 << 30)) + i for i in range(n)])
        reset(list(range(n)))
        while counts["env_steps"] < cfg.steps_per_iteration:
            own = act(obs)
            action = np.empty_like(own, dtype=np.float32)
            for i in range(n):
                o = {k: v[i] for k, v in obs.items()}
                st = ops[i].step(o, {}, own[i], label=info["oracle_label"][i])
                action[i] = st.action
                seen = {k: np.array(v[i]) if k != "task" else str(v[i]) for k, v in obs.items()}
                seen.setdefault("task", "")  # a task without an instruction (PointReach)
                episodes[i].append({"obs": seen,
                                    "label": np.array(st.action if cfg.label == "operator" else st.label, np.float32),
                                    "intervention": st.intervening, "flags": np.array(info["label_flags"][i]),
                                    "waypoints": None, "scene": None, "chunk": None})
            obs, _r, term, trunc, info = envs.step(action)
            counts["env_steps"] += n
            done = np.logical_or(term, trunc)
            for i in np.flatnonzero(done):
                frames += interventions(episodes[i])
                if ends is not None:
                    ends.append((counts["env_steps"] // n, len(frames)))
                episodes[i] = []
                ops[i].reset_episode()
                counts["episodes"] += 1
            if done.any():
                reset([int(i) for i in np.flatnonzero(done)])
    finally:
        envs.close()
    for ep in episodes:
        frames += interventions(ep)
    counts["takeovers"] = sum(op.takeovers for op in ops)
    counts["lapses"] = sum(op.lapses for op in ops)
    return frames, counts


def interventions(episode: list[dict]) -> list[dict]:
    """The intervention states of one episode, each with its target (the labels that follow it
    within the same intervention) and its place in the episode (for the temporal context)."""
    out, j = [], 0
    while j < len(episode):
        if not episode[j]["intervention"]:
            j += 1
            continue
        k = j
        while k < len(episode) and episode[k]["intervention"]:
            k += 1
        labels = np.stack([f["label"] for f in episode[j:k]])
        for m in range(j, k):
            f = episode[m]
            f["future"], f["episode"], f["index"] = labels[m - j:], episode, m
            out.append(f)
        j = k
    return out


def train(cfg: HGDAggerConfig, policy=None, log: Callable[[str], None] = print) -> dict:
    """Run HG-DAgger; returns a summary (labels and gain side by side) and saves ``out/final``."""
    from robopolicy.models.loading import load_policy
    from robopolicy.train.trainer import resolve_device

    torch.manual_seed(cfg.seed)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    rng, prng = np.random.default_rng(cfg.seed), random.Random(cfg.seed)
    device = resolve_device(cfg.device)
    policy = policy or load_policy(cfg.base)
    trainee, _ = dagger.resolve_learner(policy, "policy")
    if policy.output == "waypoints":
        raise ValueError("hg-dagger: a waypoint policy is relabelled by --method dagger (the operator gives actions)")
    out = Path(cfg.out)
    curve = Curve(out, "curve")
    t0, started = time.perf_counter(), time.time()
    before = dagger.evaluate(policy, cfg, None)
    curve.add(0, before.success, **before.metrics)
    log(f"[hg-dagger] before: success {before.success:.1%}; fine-tuning on {device}")
    original = dagger.original_dataset(cfg, trainee)
    data: list[dict] = []
    totals = {"env_steps": 0, "takeovers": 0, "lapses": 0, "episodes": 0, "labels": 0, "dropped": 0}
    with rollout_pool(cfg, policy) as pool:  # Ray workers holding the policy (backend: ray), else None
        for it in range(cfg.iterations):
            frames, counts = collect(policy, cfg, rng) if pool is None else hg_dagger_rollout(pool, policy, cfg, rng)
            kept = [f for f in frames if dagger.keep(f, cfg.filter)]
            for k in ("env_steps", "takeovers", "lapses", "episodes"):
                totals[k] += counts[k]
            totals["labels"] += len(frames)
            totals["dropped"] += len(frames) - len(kept)
            data += kept
            if cfg.max_states and len(data) > cfg.max_states:
                data = data[-cfg.max_states:]
            loss = dagger.finetune(trainee, data, cfg, prng, original) if data else float("nan")
            res = dagger.evaluate(policy, cfg, None)
            curve.add(totals["env_steps"], res.success, **res.metrics)
            if curve.is_best() and res.success > before.success:
                policy.save(out / "best")
            log(f"[hg-dagger] iteration {it}: {counts['takeovers']} take-overs, labels {len(frames)} of "
                f"{counts['env_steps']} steps ({len(kept)} kept), aggregate {len(data)}, loss {loss:.4f}, "
                f"success {res.success:.1%} (gain {100 * (res.success - before.success):+.1f} pts)")
    policy.save(out / "final")
    after = curve.rows[-1]["success"]
    summary = {"before": before.success, "after": after, "gain_pts": 100 * (after - before.success),
               "labels": totals["labels"], "env_steps": totals["env_steps"],
               "label_fraction": totals["labels"] / max(1, totals["env_steps"]),
               "takeovers": totals["takeovers"], "lapses": totals["lapses"], "episodes": totals["episodes"],
               "dropped_states": totals["dropped"], "aggregate_states": len(data), "label": cfg.label,
               "rollout_reruns": pool.stats.reruns if pool is not None else 0,
               "operator": dict(cfg.operator), **curve.best_summary(above=before.success),
               "seconds": time.perf_counter() - t0, "device": str(device), "checkpoint": str(out / "final")}
    log(f"[hg-dagger] labels {summary['labels']} ({summary['label_fraction']:.1%} of {summary['env_steps']} steps) | "
        f"gain {summary['gain_pts']:+.1f} pts ({before.success:.1%} -> {after:.1%})")
    write_refine_summary(cfg, summary, started)
    return summary
