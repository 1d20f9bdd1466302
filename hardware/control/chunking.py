"""From predicted chunks to one action per step, for a batch of envs: the one chunk executor.

    ex = ChunkExecutor(mode="chunk", steps_per_chunk=8)    # or "ensemble", "crossfade"
    ex.resize(n_envs)
    rows = ex.needs()                   # (N,) bool: envs whose next step needs a fresh chunk
    ex.add(np.flatnonzero(rows), chunks)    # chunks (R, H, A) for those rows
    actions = ex.next()                 # (N, A) this step's actions; advances one step

Numpy only, so the learning side (eval and every refinement method) and the real-time
:class:`~hardware.control.scheduler.ActionScheduler` share it; the scheduler works in continuous
time and takes its blend weights from :func:`ensemble_weights` and :func:`crossfade_weights`.

Modes, per env:

* ``"chunk"``: execute ``steps_per_chunk`` steps of a chunk (default: all of it), then ask again.
* ``"ensemble"``: temporal ensembling (ACT). Ask every ``steps_per_chunk`` steps (default 1);
  each step is the mean of every stored chunk covering it, weighted ``exp(-k i)`` with
  ``i = 0`` for the oldest (older predictions count more).
* ``"crossfade"``: ask every ``steps_per_chunk`` steps (default half the chunk); a new chunk
  takes over from the rest of the previous plan linearly over ``crossfade_steps`` steps.

A waypoint policy (``kind="waypoints"``, sets ``(K, 3)`` robot-frame ``(x, y, yaw)``) hands its
whole set to a follower each step; a held set is advanced with :func:`advance_waypoints`.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

MODES = ("chunk", "ensemble", "crossfade")


def ensemble_weights(n: int, k: float) -> np.ndarray:
    """Temporal-ensembling weights ``(n,)`` of ``n`` chunks covering a step, oldest first:
    ``exp(-k i)``, normalised to sum 1."""
    w = np.exp(-float(k) * np.arange(n))
    return w / w.sum()


def crossfade_weights(takeover: Sequence[float]) -> list[float]:
    """Crossfade weights of ``n`` plans, oldest first, where ``takeover[j]`` in [0, 1] is how far
    plan ``j`` has taken over from the ones before it (``takeover[0]`` is ignored: the oldest
    plan holds what no newer one has taken). Plan ``j`` ends with ``a_j * prod_{m>j} (1 - a_m)``."""
    n = len(takeover)
    weights, keep = [0.0] * n, 1.0
    for j in range(n - 1, 0, -1):
        a = min(1.0, max(0.0, float(takeover[j])))
        weights[j] = a * keep
        keep *= 1.0 - a
    if n:
        weights[0] = keep
    return weights


def _se2_inverse_apply(origin: np.ndarray, poses: np.ndarray) -> np.ndarray:
    """Express ``poses (N, 3)`` in the frame of ``origin (3,)`` (both in the same frame)."""
    c, s = math.cos(origin[2]), math.sin(origin[2])
    dx, dy = poses[:, 0] - origin[0], poses[:, 1] - origin[1]
    yaw = (poses[:, 2] - origin[2] + math.pi) % (2 * math.pi) - math.pi
    return np.stack([c * dx + s * dy, -s * dx + c * dy, yaw], axis=1)


def _se2_compose(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pose ``b (3,)`` given in frame ``a (3,)``, expressed in a's parent frame."""
    c, s = math.cos(a[2]), math.sin(a[2])
    return np.array([a[0] + c * b[0] - s * b[1], a[1] + s * b[0] + c * b[1], a[2] + b[2]])


def advance_waypoints(waypoints: np.ndarray) -> np.ndarray:
    """Waypoints ``(K, 3)`` one step later, assuming the robot reached waypoint 0: the rest in
    waypoint 0's frame, extended by repeating the last step's relative motion (length stays K)."""
    wp = np.asarray(waypoints, dtype=np.float64)
    if wp.shape[0] == 1:
        return wp.astype(np.float32)  # a single waypoint: the same relative motion again
    step = _se2_inverse_apply(wp[-2], wp[-1:])[0]
    extended = np.concatenate([wp, _se2_compose(wp[-1], step)[None]], axis=0)
    return _se2_inverse_apply(wp[0], extended[1:]).astype(np.float32)


class ChunkExecutor:
    """Per env (row), the chunks in flight and the step each has reached.

    Args:
        mode: ``"chunk"``, ``"ensemble"`` or ``"crossfade"`` (see the module docstring).
        steps_per_chunk: steps between two requests; ``None`` or 0: the mode's default.
        ensemble_coeff: ``k`` of the ensembling weights ``exp(-k i)``.
        crossfade_steps: steps over which a new chunk takes over (0: at once).
        kind: ``"action"`` (chunks ``(H, A)``) or ``"waypoints"`` (sets ``(K, 3)``, mode chunk).
        n_envs: rows to start with (:meth:`resize` changes it).
    """

    def __init__(self, mode: str = "chunk", steps_per_chunk: int | None = None, ensemble_coeff: float = 0.01,
                 crossfade_steps: int = 4, kind: str = "action", n_envs: int = 0):
        if kind not in ("action", "waypoints"):
            raise ValueError(f"kind must be 'action' or 'waypoints', got {kind!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if kind == "waypoints" and mode != "chunk":
            raise ValueError("ensembling and crossfade apply to action chunks; waypoint policies use mode 'chunk'")
        if (steps_per_chunk or 0) < 0 or crossfade_steps < 0 or ensemble_coeff < 0:
            raise ValueError("steps_per_chunk, crossfade_steps and ensemble_coeff must be >= 0")
        self.mode, self.kind = mode, kind
        self.steps_per_chunk = int(steps_per_chunk or 0)
        self.k, self.crossfade_steps = float(ensemble_coeff), int(crossfade_steps)
        self._live: list[list[list]] = []  # per row: [values (H, A), age] oldest first
        self._budget: list[int] = []  # per row: steps to take from its newest chunk before asking again
        self.resize(n_envs)

    @property
    def n_envs(self) -> int:
        return len(self._live)

    def resize(self, n: int) -> bool:
        """Hold ``n`` rows; a new size forgets every chunk. Returns whether the size changed."""
        if n == len(self._live):
            return False
        self._live = [[] for _ in range(n)]
        self._budget = [0] * n
        return True

    def reset(self, rows: Sequence[int] | None = None) -> None:
        """Forget the chunks of ``rows`` (all when ``None``): those envs start a new episode."""
        for r in range(self.n_envs) if rows is None else rows:
            if 0 <= r < self.n_envs:
                self._live[r], self._budget[r] = [], 0

    def executed(self) -> np.ndarray:
        """``(N,)`` steps each row has taken from its newest chunk (0 right after :meth:`add`)."""
        return np.array([live[-1][1] if live else 0 for live in self._live], dtype=np.int64)

    def needs(self) -> np.ndarray:
        """``(N,)`` bool: rows whose next step needs a fresh chunk."""
        return np.array([not live or live[-1][1] >= b for live, b in zip(self._live, self._budget)], dtype=bool)

    def add(self, rows: Sequence[int], chunks: np.ndarray) -> None:
        """Store ``chunks (R, H, A)`` (or ``(R, K, 3)`` waypoints) for ``rows`` (R of them)."""
        chunks = np.asarray(chunks, dtype=np.float32)
        rows = [int(r) for r in rows]
        if chunks.ndim != 3 or len(chunks) != len(rows):
            raise ValueError(f"add() takes one (H, A) chunk per row: {len(rows)} rows, chunks of shape {chunks.shape}")
        h = chunks.shape[1]
        for r, chunk in zip(rows, chunks):
            live = self._live[r]
            if self.mode == "chunk":
                live.clear()
            live.append([chunk, 0])
            self._budget[r] = min(self._default_budget(h), h) if self.kind == "action" else self._default_budget(1)

    def _default_budget(self, h: int) -> int:
        if self.steps_per_chunk:
            return self.steps_per_chunk
        return {"chunk": h, "ensemble": 1, "crossfade": max(1, h // 2)}[self.mode]

    def next(self, rows: Sequence[int] | None = None, peek: bool = False) -> np.ndarray:
        """This step's actions ``(R, A)`` (or waypoint sets ``(R, K, 3)``) of ``rows`` (all when
        ``None``); advances those rows one step unless ``peek``. Each must hold a chunk (see
        :meth:`needs`)."""
        rows = range(self.n_envs) if rows is None else [int(r) for r in rows]
        out = [self._row(self._live[r], self._budget[r], peek) for r in rows]
        return np.stack(out) if out else np.zeros((0, 0), np.float32)

    def _row(self, live: list[list], budget: int, peek: bool) -> np.ndarray:
        if not live or (self.mode == "chunk" and live[-1][1] >= budget):
            raise RuntimeError("no chunk left to execute in a row: add() a prediction first")
        if self.kind == "waypoints":
            values, age = live[-1]
            if not peek:
                live[-1] = [advance_waypoints(values), age + 1]
            return np.array(values, dtype=np.float32)
        covering = [entry for entry in live if entry[1] < len(entry[0])] or live[-1:]
        steps = np.stack([v[min(age, len(v) - 1)] for v, age in covering])  # oldest first
        if self.mode == "chunk" or len(covering) == 1:
            action = steps[-1]
        elif self.mode == "ensemble":
            action = ensemble_weights(len(covering), self.k) @ steps
        else:
            cf = self.crossfade_steps
            weights = crossfade_weights([1.0 if cf == 0 else (age + 1) / (cf + 1) for _, age in covering])
            action = np.asarray(weights) @ steps
        if not peek:
            for entry in live:
                entry[1] += 1
            # spent chunks go; the newest stays, so needs() sees that it is spent
            live[:] = [e for e in live if e[1] < len(e[0])] or live[-1:]
        return action.astype(np.float32)
