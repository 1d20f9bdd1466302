"""Batches for the trainer: cached encoder features (fast path) or decoded frames (DataLoader).

Both yield dicts shaped like a collated ``TrainingDataset`` batch (``robopolicy.data.loader``);
the cached path replaces the camera images by ``features (B, T, V, n, C)`` float32.

:class:`CachedFeatureBatches` builds a whole batch with vectorized numpy indexing from the
training cache's in-memory columns and the feature arrays: no per-sample Python and no worker
processes, which is what lets a small model train at thousands of samples/s on a CPU.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np
import torch

from robopolicy.data.loader import TrainingDataset


class CachedFeatureBatches:
    """Random batches from ``dataset`` with per-frame ``features {role: (N, n, C)}`` (``{}`` for a
    dataset read without cameras).

    Context, chunk and padding follow the loader exactly: context frame ``max(t - s, start)``,
    chunk step ``min(t + h, end - 1)``, flags for what fell outside the episode.
    """

    def __init__(self, dataset: TrainingDataset, features: Mapping[str, np.ndarray], batch_size: int,
                 seed: int = 0):
        self.ds, self.batch_size = dataset, int(batch_size)
        self.roles = list(dataset.cameras)
        missing = [r for r in self.roles if r not in features]
        if missing:
            raise ValueError(f"no cached features for camera {missing[0]!r}")
        self.features = [features[r] for r in self.roles]
        cache = dataset.cache
        by_index = {e["episode_index"]: e for e in cache.episodes}
        eps = [by_index[i] for i in dataset.episodes]
        self.rows = np.concatenate([np.arange(e["from"], e["to"]) for e in eps]).astype(np.int64)
        self.start = np.concatenate([np.full(e["to"] - e["from"], e["from"]) for e in eps]).astype(np.int64)
        self.end = np.concatenate([np.full(e["to"] - e["from"], e["to"]) for e in eps]).astype(np.int64)
        low = cache.lowdim
        self.state = low[dataset.state_key].astype(np.float32) if dataset.state_key else None
        self.action = low[dataset.action_key].astype(np.float32)
        self.labels = {k: low[k] for k in dataset.labels}
        self.task_index = low["task_index"].astype(np.int64)
        self.tasks = list(cache.tasks)
        self.strides = np.asarray(dataset.context_strides, dtype=np.int64)
        self.future = np.arange(dataset.horizon, dtype=np.int64)
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, idx: np.ndarray) -> dict:
        """The samples ``idx`` (positions in this dataset) as one batch."""
        row, start, end = self.rows[idx], self.start[idx], self.end[idx]
        past = row[:, None] - self.strides[None]
        context = np.maximum(past, start[:, None])  # (B, T)
        future = row[:, None] + self.future[None]
        chunk = np.minimum(future, end[:, None] - 1)  # (B, H)
        out = {
            "observation_is_pad": torch.from_numpy(past < start[:, None]),
            "action": torch.from_numpy(self.action[chunk]),
            "action_is_pad": torch.from_numpy(future >= end[:, None]),
            "task": [self.tasks[i] for i in self.task_index[row]],
            "index": torch.from_numpy(row),
        }
        if self.features:  # a policy without cameras trains on the low-dimensional columns alone
            feats = np.stack([f[context] for f in self.features], axis=2)  # (B, T, V, n, C)
            out["features"] = torch.from_numpy(feats.astype(np.float32, copy=False))
        if self.state is not None:
            out["observation.state"] = torch.from_numpy(self.state[context])
        for key, values in self.labels.items():
            out[key] = torch.from_numpy(np.asarray(values[row]))
        return out

    def __iter__(self) -> Iterator[dict]:
        """Endless shuffled epochs (the last partial batch of an epoch is dropped)."""
        n = len(self.rows)
        bs = min(self.batch_size, n)
        while True:
            order = self.rng.permutation(n)
            for i in range(0, n - bs + 1, bs):
                yield self.batch(order[i:i + bs])


def frame_batches(dataset: TrainingDataset, batch_size: int, num_workers: int = 0, seed: int = 0) -> Iterator[dict]:
    """Endless shuffled batches of decoded frames through a torch DataLoader."""
    g = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=min(batch_size, len(dataset)), shuffle=True,
                                         drop_last=True, num_workers=num_workers, generator=g,
                                         persistent_workers=num_workers > 0)
    while True:
        yield from loader
