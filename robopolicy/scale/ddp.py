"""Data-parallel training with torch DDP, launched by torchrun.

``robopolicy train ... --nproc N`` re-runs the same command under ``torch.distributed.run`` with N
processes on this machine (:func:`launch`). Each process then sees ``WORLD_SIZE``/``RANK``/
``LOCAL_RANK`` and the trainer:

- joins the process group (:func:`Dist.init`): NCCL when it trains on CUDA, gloo on the CPU;
- wraps the policy's loss in :class:`torch.nn.parallel.DistributedDataParallel` (:class:`LossModule`);
- draws the SAME global batch on every rank (same seed) and keeps its own contiguous slice of
  ``batch_size / N`` samples, so N processes step on exactly the samples one process would;
- lets rank 0 alone build the shared caches first (:meth:`Dist.rank_zero_first`), write
  checkpoints, metrics and summaries; the others wait at a barrier.

Outside torchrun (``WORLD_SIZE`` unset or 1) every helper is a no-op and training is unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch


def launch_command(cli_args: Sequence[str], nproc: int) -> list[str]:
    """The torchrun command that runs ``robopolicy <cli_args>`` in ``nproc`` processes on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={int(nproc)}",
            "-m", "robopolicy", *cli_args]


def launch(cli_args: Sequence[str], nproc: int) -> int:
    """Run ``robopolicy <cli_args>`` under torchrun with ``nproc`` processes; its exit code.

    torchrun sets ``OMP_NUM_THREADS=1`` per process unless it is already set, so N CPU processes
    share the cores instead of each taking all of them."""
    return subprocess.call(launch_command(cli_args, nproc))


@dataclass(frozen=True)
class Dist:
    """This process's place in the job: ``rank`` of ``world`` (``local_rank`` on its machine)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "Dist":
        """The job torchrun describes in the environment (one process when it describes none)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        return cls(rank=int(os.environ["RANK"]), world=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """``device`` for this rank: ``cuda`` without an index becomes ``cuda:<local_rank>``."""
        if self.enabled and device.type == "cuda" and device.index is None:
            return torch.device("cuda", self.local_rank)
        return device

    def init(self, device: torch.device) -> None:
        """Join the process group (NCCL for CUDA, gloo otherwise); a no-op for one process."""
        if not self.enabled or torch.distributed.is_initialized():
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.distributed.init_process_group(backend=backend, rank=self.rank, world_size=self.world)

    def close(self) -> None:
        if self.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    @contextmanager
    def rank_zero_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. builds a cache on disk), the others after it (and read it)."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def seed(self, seed: int) -> int:
        """The torch seed of this rank: rank 0 keeps ``seed`` (as one process would), the others
        take distinct ones so dropout and sampled noise differ across the shards of a batch."""
        return seed if self.rank == 0 else seed + 1_000_003 * self.rank

    @property
    def shard(self) -> tuple[int, int]:
        """``(rank, world)``: which contiguous part of every global batch this process trains on."""
        return self.rank, self.world

    def check_batch(self, batch_size: int) -> str | None:
        """Why ``batch_size`` cannot be split evenly over the ranks (``None``: it can)."""
        if batch_size % self.world:
            return f"batch_size={batch_size} is not a multiple of the {self.world} processes (--nproc)"
        return None

    def mean(self, values: dict[str, float], device: torch.device) -> dict[str, float]:
        """``values`` averaged over the ranks (the global batch's loss when each rank holds its
        shard's); ``device``: where the collective runs (the CUDA device under NCCL)."""
        if not self.enabled or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t)
        return {k: float(v) / self.world for k, v in zip(keys, t.tolist())}


class LossModule(torch.nn.Module):
    """``policy.losses(batch, weights)`` as a module's forward, so DDP sees the call and
    averages the gradients of every rank's shard during backward."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, batch: dict, weights: dict[str, float]) -> dict[str, torch.Tensor]:
        return self.policy.losses(batch, weights)


def wrap(policy: torch.nn.Module, dist: Dist, device: torch.device):
    """The callable the trainer computes its losses with: ``policy.losses`` for one process, a DDP
    :class:`LossModule` for several (which broadcasts rank 0's weights at construction)."""
    if not dist.enabled:
        return policy.losses
    ids = [device.index] if device.type == "cuda" else None
    # auxiliary heads whose loss weight is 0 get no gradient: DDP must not wait for them
    return torch.nn.parallel.DistributedDataParallel(LossModule(policy), device_ids=ids,
                                                     find_unused_parameters=True)
