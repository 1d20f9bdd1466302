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
                 seed: int = 0, shard: tuple[int, int] = (0, 1)):
        self.ds, self.batch_size, self.shard = dataset, int(batch_size), shard
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
        """Endless shuffled epochs (the last partial batch of an epoch is dropped). With
        ``shard=(rank, world)`` every rank draws the same global batch and yields its own part."""
        n = len(self.rows)
        world = self.shard[1]
        bs = min(self.batch_size, n) // world * world  # a dataset smaller than a batch: equal shares still
        part = _part(bs, *self.shard)
        while True:
            order = self.rng.permutation(n)
            for i in range(0, n - bs + 1, bs):
                yield self.batch(order[i:i + bs][part])


def _part(batch_size: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s contiguous share of a global batch of ``batch_size`` (an equal share each)."""
    per_rank = batch_size // world
    return slice(rank * per_rank, (rank + 1) * per_rank)


class ShardedBatches(torch.utils.data.Sampler):
    """Batch indices for one rank of ``world``: every rank shuffles with the same seed, takes the
    same global batches and keeps its own share of each (a new permutation every epoch)."""

    def __init__(self, n: int, batch_size: int, seed: int, rank: int, world: int):
        self.n, self.bs, self.seed = n, min(batch_size, n) // world * world, seed
        self.part = _part(self.bs, rank, world)
        self.epoch = 0

    def __len__(self) -> int:
        return self.n // self.bs

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        self.epoch += 1
        for i in range(0, self.n - self.bs + 1, self.bs):
            yield order[i:i + self.bs][self.part].tolist()


def frame_batches(dataset: TrainingDataset, batch_size: int, num_workers: int = 0, seed: int = 0,
                  shard: tuple[int, int] = (0, 1)) -> Iterator[dict]:
    """Endless shuffled batches of decoded frames through a torch DataLoader (``shard=(rank, world)``:
    this rank's share of each global batch, see :class:`ShardedBatches`)."""
    if shard[1] > 1:
        sampler = ShardedBatches(len(dataset), batch_size, seed, *shard)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                             persistent_workers=num_workers > 0)
    else:
        g = torch.Generator().manual_seed(seed)
        loader = torch.utils.data.DataLoader(dataset, batch_size=min(batch_size, len(dataset)), shuffle=True,
                                             drop_last=True, num_workers=num_workers, generator=g,
                                             persistent_workers=num_workers > 0)
    while True:
        yield from loader
