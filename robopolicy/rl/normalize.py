"""Running statistics: the actor-critic's input standardization and the reward scale (ResiP)."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


class RunningNorm(nn.Module):
    """Running mean / variance of inputs ``(B, D)`` (buffers: saved with the checkpoint)."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.tensor(1e-4))

    def update(self, x: torch.Tensor) -> None:
        """Fold a batch ``x (B, D)`` into the statistics (parallel Welford)."""
        m, v, n = x.mean(0), x.var(0, unbiased=False), x.shape[0]
        total = self.count + n
        delta = m - self.mean
        self.mean += delta * n / total
        self.var = (self.var * self.count + v * n + delta**2 * self.count * n / total) / total
        self.count = total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (B, D)`` standardized and clamped to ±10."""
        return ((x - self.mean) / (self.var.sqrt() + 1e-6)).clamp(-10, 10)


class RewardScaler:
    """Divide rewards by the running std of the discounted return (per env), then clip (ResiP)."""

    def __init__(self, num_envs: int, gamma: float, clip: float = 5.0):
        self.gamma, self.clip = gamma, clip
        self.ret = np.zeros(num_envs)
        self.count, self.mean, self.m2 = 1e-4, 0.0, 0.0

    def __call__(self, reward: np.ndarray, done: np.ndarray) -> np.ndarray:
        """``(N,)`` rewards of one step of ``N`` envs → scaled and clipped; ``done`` ends returns."""
        self.ret = self.ret * self.gamma + reward
        for x in self.ret:  # Welford over every env's running return
            self.count += 1
            delta = x - self.mean
            self.mean += delta / self.count
            self.m2 += delta * (x - self.mean)
        self.ret[done] = 0.0
        std = math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0
        return np.clip(reward / max(std, 1e-8), -self.clip, self.clip)
