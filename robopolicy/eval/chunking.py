"""One env's view of the chunk executor, for code written against the per-env interface.

The executor itself, batched over envs, is :class:`hardware.control.chunking.ChunkExecutor`
(queue, temporal ensembling, crossfade); use it directly in new code.
"""

from __future__ import annotations

import numpy as np

from hardware.control.chunking import ChunkExecutor as BatchChunkExecutor
from hardware.control.chunking import advance_waypoints

__all__ = ["BatchChunkExecutor", "ChunkExecutor", "advance_waypoints"]


class ChunkExecutor:
    """A one-row :class:`BatchChunkExecutor`: ``needs_chunk()``, ``add(chunk (H, A))``, ``next_action()``."""

    def __init__(self, kind: str = "action", mode: str = "chunk", steps_per_chunk: int | None = None,
                 ensemble_coeff: float = 0.01):
        self._ex = BatchChunkExecutor(mode, steps_per_chunk, ensemble_coeff, kind=kind, n_envs=1)

    def reset(self) -> None:
        self._ex.reset()

    def needs_chunk(self) -> bool:
        return bool(self._ex.needs()[0])

    def add(self, chunk: np.ndarray) -> None:
        self._ex.add([0], np.asarray(chunk)[None])

    def next_action(self) -> np.ndarray:
        return self._ex.next()[0]
