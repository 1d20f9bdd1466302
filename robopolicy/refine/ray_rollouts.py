"""Refinement rollouts on Ray workers (``backend: ray`` of DAgger and HG-DAgger).

    with rollout_pool(cfg, policy) as pool:               # None with backend: local
        frames = dagger_rollout(pool, policy, cfg, beta, rng, waypoints, scene_label)

Row ``i`` of the local rollout's vector env becomes one item on a Ray rollout worker
(:class:`robopolicy.scale.ray_backend.RolloutPool`): the worker runs that row's whole rollout of
the iteration (the current policy, pushed to every worker before it, through the chunk executor,
the labeller, one env) with the local loop itself (:func:`robopolicy.refine.dagger.collect` or
:func:`robopolicy.teleop.hg_dagger.collect` over one env), and returns the row's labelled episodes.

Same seeds, same episodes: the driver draws from its generator exactly what the local rollout
draws (the env seed, the operators' seeds, DAgger's beta mask of every step) and hands each row its
share (:class:`ReplayRng`). The rows' episodes are then put in the order the local rollout adds
them (finished episodes by the step they ended, rows in order within a step; then the episodes
still running, by row), so the aggregate and fine-tuning's draws from it are the local ones, for a
policy whose rows do not depend on each other (batched and one-row predictions equal).

A worker that dies is replaced and its row runs again from its seed (``pool.stats``); the rows'
results reach the driver once.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Sequence

import numpy as np


class ReplayRng:
    """A stand-in for the rollout's ``numpy.random.Generator`` inside one row: ``integers()``
    gives ``ints`` in order, ``random(1)`` the row's next value of ``randoms`` (one per step)."""

    def __init__(self, ints: Sequence[int], randoms: Sequence[float] = ()):
        self._ints, self._randoms = list(ints), np.asarray(randoms, np.float64)
        self._next = 0

    def integers(self, *args: Any, **kwargs: Any) -> int:
        return self._ints.pop(0)

    def random(self, size: int | None = None):
        value = self._randoms[self._next]
        self._next += 1
        return value if size is None else np.full(size, value)

    def spent(self) -> bool:
        """Whether every value was drawn (the row made the local rollout's draws)."""
        return not self._ints and self._next == len(self._randoms)


def rollout_pool(cfg: Any, policy: Any):
    """The Ray workers of a refinement run (one per env, each holding ``policy``) with
    ``cfg.backend == "ray"``, as a context manager that closes them however the run ends:
    ``with rollout_pool(cfg, policy) as pool`` (``pool`` is ``None`` with ``local``)."""
    if cfg.backend != "ray":
        return contextlib.nullcontext()
    from robopolicy.scale.ray_backend import RolloutPool

    return RolloutPool(policy, cfg.num_envs, cfg.ray, cfg.threads)


def row_steps(cfg: Any) -> int:
    """Vector steps of one iteration's rollout: the local loop steps all envs until
    ``steps_per_iteration`` env steps are reached."""
    return -(-int(cfg.steps_per_iteration) // int(cfg.num_envs))


def _row_config(cfg: Any, steps: int) -> Any:
    return replace(cfg, num_envs=1, steps_per_iteration=steps, backend="local")


def merge_rows(rows: Sequence[tuple[list[dict], list[tuple[int, int]]]]) -> list[dict]:
    """The rows' frames in the local rollout's order. Row ``r`` gives its frames and ``ends``: for
    each finished episode, (vector steps at its end, frames of the row up to and with it)."""
    finished, running = [], []
    for r, (frames, ends) in enumerate(rows):
        start = 0
        for step, stop in ends:
            finished.append((step, r, frames[start:stop]))
            start = stop
        running.append(frames[start:])
    out: list[dict] = []
    for _, _, frames in sorted(finished, key=lambda e: (e[0], e[1])):
        out += frames
    for frames in running:
        out += frames
    return out


# ----------------------------------------------------------------------------- DAgger
def _dagger_row(worker: Any, job: tuple) -> tuple[list[dict], list[tuple[int, int]]]:
    """One row's DAgger rollout on a worker: the local loop over one env, the row's draws replayed."""
    from robopolicy.refine import dagger

    cfg, beta, seed, mask, waypoints, scene_label = job
    rng, ends = ReplayRng([seed], mask), []
    frames = dagger.collect(worker.policy, _row_config(cfg, len(mask)), beta, rng, waypoints, scene_label,
                            ends=ends)
    assert rng.spent(), "the row's rollout drew other values than the local rollout"
    return frames, ends


def dagger_rollout(pool: Any, policy: Any, cfg: Any, beta: float, rng: np.random.Generator,
                   waypoints: int | None, scene_label: str | None = None) -> list[dict]:
    """:func:`robopolicy.refine.dagger.collect` on the Ray workers of ``pool``: the same frames,
    labels and flags, in the same order, for the same generator state."""
    n, steps = int(cfg.num_envs), row_steps(cfg)
    seeds = [int(rng.integers(1 << 30)) + i for i in range(n)]  # the local loop's draws, in its order
    mask = rng.random((steps, n))
    pool.push(policy)
    jobs = [(cfg, beta, seeds[i], mask[:, i], waypoints, scene_label) for i in range(n)]
    return merge_rows(pool.map(_dagger_row, jobs))


# ----------------------------------------------------------------------------- HG-DAgger
def _hg_dagger_row(worker: Any, job: tuple) -> tuple[list[dict], list[tuple[int, int]], dict]:
    """One row's HG-DAgger rollout on a worker (its operator, its env)."""
    from robopolicy.teleop import hg_dagger

    cfg, operator_seed, seed, steps = job
    rng, ends = ReplayRng([operator_seed, seed]), []
    frames, counts = hg_dagger.collect(worker.policy, _row_config(cfg, steps), rng, ends=ends)
    assert rng.spent(), "the row's rollout drew other values than the local rollout"
    return frames, ends, counts


def hg_dagger_rollout(pool: Any, policy: Any, cfg: Any, rng: np.random.Generator) -> tuple[list[dict], dict]:
    """:func:`robopolicy.teleop.hg_dagger.collect` on the Ray workers of ``pool``: the same
    intervention frames in the same order, and the counts summed over the rows."""
    n = int(cfg.num_envs)
    operator_seeds = [int(rng.integers(1 << 30)) for _ in range(n)]  # the local loop's draws, in its order
    seeds = [int(rng.integers(1 << 30)) + i for i in range(n)]
    pool.push(policy)
    rows = pool.map(_hg_dagger_row, [(cfg, operator_seeds[i], seeds[i], row_steps(cfg)) for i in range(n)])
    counts = {k: sum(r[2][k] for r in rows) for k in rows[0][2]}
    return merge_rows([(frames, ends) for frames, ends, _ in rows]), counts
