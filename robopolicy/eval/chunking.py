"""From predicted chunks to one action per step: chunk execution and temporal ensembling.

Per env, numpy only. An :class:`ChunkExecutor` is fed chunks with :meth:`~ChunkExecutor.add` when
it :meth:`~ChunkExecutor.needs_chunk` and gives the action of the current step with
:meth:`~ChunkExecutor.next_action`.

Shapes: an action chunk is ``(H, A)``; a waypoint set is ``(K, 3)`` robot-frame ``(x, y, yaw)``
(waypoint 0 is where the robot should be after one step).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np


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
    """Waypoints ``(K, 3)`` one step later, assuming the robot reached waypoint 0.

    The rest are re-expressed in waypoint 0's frame and the set is extended by repeating the last
    step's relative motion, so a held waypoint set keeps its length ``K``.
    """
    wp = np.asarray(waypoints, dtype=np.float64)
    k = wp.shape[0]
    if k == 1:
        return wp.copy()  # a single waypoint: the same relative motion again
    step = _se2_inverse_apply(wp[-2], wp[-1:])[0]
    extended = np.concatenate([wp, _se2_compose(wp[-1], step)[None]], axis=0)
    return _se2_inverse_apply(wp[0], extended[1:]).astype(np.float32)


class ChunkExecutor:
    """Turns predicted chunks into one action per step, for one env.

    Args:
        kind: ``"action"`` (chunks ``(H, A)``) or ``"waypoints"`` (``(K, 3)``, executed whole
            each step by a follower).
        mode: ``"chunk"`` (run ``steps_per_chunk`` steps of a chunk, then ask again) or
            ``"ensemble"`` (ask every step; blend all chunks covering the step).
        steps_per_chunk: ``None``: the chunk length for actions, 1 for waypoints.
        ensemble_coeff: weight ``exp(-coeff * i)`` of the i-th oldest chunk covering a step.
    """

    def __init__(self, kind: str = "action", mode: str = "chunk", steps_per_chunk: int | None = None,
                 ensemble_coeff: float = 0.01):
        if kind not in ("action", "waypoints"):
            raise ValueError(f"kind must be 'action' or 'waypoints', got {kind!r}")
        if mode not in ("chunk", "ensemble"):
            raise ValueError(f"mode must be 'chunk' or 'ensemble', got {mode!r}")
        if kind == "waypoints" and mode == "ensemble":
            raise ValueError("temporal ensembling applies to action chunks; waypoint policies use mode 'chunk'")
        self.kind, self.mode = kind, mode
        self.steps_per_chunk = steps_per_chunk
        self.ensemble_coeff = float(ensemble_coeff)
        self.reset()

    def reset(self) -> None:
        """Forget every chunk (start of an episode)."""
        self._chunk: np.ndarray | None = None
        self._used = 0
        self._budget = 0
        self._stored: deque[list] = deque()  # ensemble: [chunk (H, A), age]

    def needs_chunk(self) -> bool:
        """Whether the next step needs a fresh prediction."""
        if self.mode == "ensemble":
            return True
        return self._chunk is None or self._used >= self._budget

    def add(self, chunk: np.ndarray) -> None:
        """Store a new prediction: ``(H, A)`` actions or ``(K, 3)`` waypoints."""
        chunk = np.asarray(chunk, dtype=np.float32)
        if chunk.ndim != 2:
            raise ValueError(f"a chunk must be 2-D ((H, A) or (K, 3)), got shape {chunk.shape}")
        if self.mode == "ensemble":
            self._stored.append([chunk, 0])
            return
        self._chunk, self._used = chunk, 0
        if self.kind == "waypoints":
            self._budget = self.steps_per_chunk or 1
        else:
            self._budget = min(self.steps_per_chunk or chunk.shape[0], chunk.shape[0])

    def next_action(self) -> np.ndarray:
        """The action (``(A,)``) or waypoint set (``(K, 3)``) to execute now; advances one step."""
        if self.mode == "ensemble":
            return self._ensembled()
        if self._chunk is None or self._used >= self._budget:
            raise RuntimeError("no chunk left to execute: add() a prediction first")
        if self.kind == "waypoints":
            out = self._chunk
            self._chunk = advance_waypoints(self._chunk)
        else:
            out = self._chunk[self._used]
        self._used += 1
        return np.array(out, dtype=np.float32)

    def _ensembled(self) -> np.ndarray:
        if not self._stored:
            raise RuntimeError("no chunk stored: add() a prediction first")
        actions = np.stack([chunk[age] for chunk, age in self._stored])  # oldest first
        weights = np.exp(-self.ensemble_coeff * np.arange(len(actions)))
        out = (weights[:, None] * actions).sum(axis=0) / weights.sum()
        for entry in self._stored:
            entry[1] += 1
        while self._stored and self._stored[0][1] >= self._stored[0][0].shape[0]:
            self._stored.popleft()
        return out.astype(np.float32)
