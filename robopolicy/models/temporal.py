"""Multiscale temporal context: frames at several strides become tokens with time embeddings.

Context ``strides = (0, 1, 4, 16)`` means the frames at ``t, t-1, t-4, t-16``. Before the episode
start the first frame is repeated (and flagged as padding), exactly as the training loader does
(``robopolicy.data.loader``), so training and inference see the same contexts.

At inference :class:`FeatureRingBuffer` keeps the last ``max(strides) + 1`` per-frame features,
so each new frame goes through the encoder once and the older frames of the context are reused.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class ContextTokens(nn.Module):
    """Per-frame grid features → one token sequence with learned time, grid and camera embeddings.

    ``forward(tokens (B, T, V, n, d))`` → ``(B, T*V*n, d)`` for T context frames, V cameras and
    n grid tokens per frame, already projected to ``d``.
    """

    def __init__(self, num_frames: int, num_cameras: int, tokens_per_frame: int, d_model: int):
        super().__init__()
        self.time = nn.Parameter(torch.randn(num_frames, d_model) * 0.02)
        self.camera = nn.Parameter(torch.randn(num_cameras, d_model) * 0.02)
        self.grid = nn.Parameter(torch.randn(tokens_per_frame, d_model) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t, v, n, d = tokens.shape
        x = tokens + self.time[None, :t, None, None] + self.camera[None, None, :v, None] + self.grid[None, None, None, :n]
        return x.reshape(b, t * v * n, d)


class FeatureRingBuffer:
    """The last ``length`` per-frame features of a batch of episodes, for context lookups.

    ``push(features (B, *F))`` stores the newest frame of every row; ``context(strides)`` returns
    ``(B, T, *F)`` frames ``t - s``, clamped to the first frame of each row's episode, and the pad
    flags ``(B, T)`` (True where ``t - s`` fell before that first frame). ``reset(rows)`` starts a
    new episode in some rows only (vectorized envs reset their sub-envs at different steps).
    """

    def __init__(self, length: int):
        if length < 1:
            raise ValueError(f"ring buffer length must be >= 1, got {length}")
        self.length = int(length)
        self.reset()

    def reset(self, rows: Sequence[int] | None = None) -> None:
        """Forget everything (``rows=None``), or start a new episode in ``rows`` at the next push."""
        if rows is None or getattr(self, "_buf", None) is None:
            self._buf: torch.Tensor | None = None
            self._start: torch.Tensor | None = None
            self.count = 0  # frames pushed since reset
            return
        # A fresh tensor, not an in-place write: the buffer may have been made under
        # torch.inference_mode(), and inference tensors cannot be modified outside it.
        start = self._start.clone()
        start[torch.as_tensor(list(rows), dtype=torch.long)] = self.count
        self._start = start

    def push(self, features: torch.Tensor) -> None:
        if self._buf is None or self._buf.shape[0] != features.shape[0] or self._buf.shape[2:] != features.shape[1:]:
            if self._buf is not None and self.count:
                raise ValueError(f"ring buffer holds frames of shape {tuple(self._buf.shape[:1] + self._buf.shape[2:])}, "
                                 f"got {tuple(features.shape)}; call reset() between episodes or batch sizes")
            self._buf = features.new_zeros((features.shape[0], self.length, *features.shape[1:]))
            self._start = torch.zeros(features.shape[0], dtype=torch.long)
        if self._buf.is_inference() and not torch.is_inference_mode_enabled():
            self._buf = self._buf.clone()
        self._buf[:, self.count % self.length] = features
        self.count += 1

    def context(self, strides: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self._buf is None or self.count == 0:
            raise RuntimeError("ring buffer is empty: push a frame first")
        steps = torch.tensor([int(s) for s in strides], dtype=torch.long)
        if int(steps.max()) >= self.length:
            raise ValueError(f"stride {int(steps.max())} does not fit a ring buffer of length {self.length}")
        wanted = (self.count - 1) - steps  # (T,)
        frames = torch.maximum(wanted[None], self._start[:, None])  # (B, T)
        rows = torch.arange(self._buf.shape[0])[:, None]
        return self._buf[rows, frames % self.length], wanted[None] < self._start[:, None]
