"""The policy side of an evaluation: batch env observations for ``Policy.predict``, numpy out.

What evaluation needs from a policy (robopolicy's ``Policy`` and any object with the same
surface, e.g. a scripted policy in a test)::

    predict(obs) -> Tensor | ndarray   (B, H, A) action chunk in env units, or (B, K, 3) waypoints
    reset()                            forget temporal context (optionally reset(rows): some rows)
    observe(obs)                       optional: push a frame on a step without a prediction
    output                             "chunk" or "waypoints" (or ``kind``: "action" / "waypoints")

``obs`` is ``{"observation.images.<cam>": uint8 (B, C, H, W), "observation.state": float32 (B, D),
"task": list[str]}``, CPU torch tensors (the policy moves them to its device).
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Mapping

import numpy as np
import torch


def policy_kind(policy: Any) -> str:
    """``"action"`` or ``"waypoints"``: what the policy's ``predict`` returns."""
    kind = getattr(policy, "output", None) or getattr(policy, "kind", None)
    if kind is None:
        head = getattr(getattr(policy, "config", None), "head", None)
        kind = head if isinstance(head, str) else getattr(head, "kind", None)
    if kind in ("waypoint", "waypoints"):
        return "waypoints"
    if kind in ("action", "chunk", "actions", "chunk_l1", "chunk_flow", None):
        return "action"
    raise ValueError(f"policy kind {kind!r} is neither 'action' nor 'waypoints'")


def context_strides(policy: Any) -> tuple[int, ...]:
    """The policy's temporal context strides (``(0,)``: it sees the current frame only)."""
    for owner in (policy, getattr(policy, "config", None)):
        strides = getattr(owner, "context_strides", None)
        if strides is not None:
            return tuple(int(s) for s in strides)
    return (0,)


def to_policy_batch(obs: Mapping[str, Any], rows: np.ndarray | None = None) -> dict[str, Any]:
    """Vector-env observations -> the policy's batch (see the module docstring for shapes).

    ``rows`` keeps only those env rows (a subset batch); ``None``: all of them.
    """
    batch: dict[str, Any] = {}
    for key, value in obs.items():
        if key == "task":
            tasks = list(value)
            batch[key] = [str(tasks[i]) for i in rows] if rows is not None else [str(t) for t in tasks]
            continue
        arr = np.asarray(value)
        if rows is not None:
            arr = arr[rows]
        tensor = torch.from_numpy(np.ascontiguousarray(arr))
        if key.startswith("observation.images."):
            tensor = tensor.permute(0, 3, 1, 2)  # (B, H, W, C) -> (B, C, H, W), still uint8
        batch[key] = tensor
    return batch


class PolicyRunner:
    """Runs a policy on vector-env observation batches; keeps latency statistics."""

    def __init__(self, policy: Any):
        self.policy = policy
        self.kind = policy_kind(policy)
        self.strides = context_strides(policy)
        self.can_observe = callable(getattr(policy, "observe", None))
        try:
            params = inspect.signature(policy.reset).parameters
        except (TypeError, ValueError):
            params = {}
        self.per_row_reset = len(params) > 0
        self.calls = 0
        self.seconds = 0.0

    @property
    def has_context(self) -> bool:
        return any(s > 0 for s in self.strides)

    @torch.inference_mode()  # the policy's context buffers were made in inference mode (predict)
    def reset(self, rows: list[int] | None = None) -> None:
        """Clear temporal state of ``rows`` (all when ``None`` or the policy resets only as a whole)."""
        if rows is None or not self.per_row_reset:
            self.policy.reset()
        else:
            self.policy.reset(rows)

    @torch.inference_mode()
    def predict(self, obs: Mapping[str, Any]) -> np.ndarray:
        """``(B, H, A)`` chunks or ``(B, K, 3)`` waypoints for the batch, as float32 numpy."""
        batch = to_policy_batch(obs)
        t0 = time.perf_counter()
        out = self.policy.predict(batch)
        if isinstance(out, torch.Tensor):
            out = out.detach().float().cpu().numpy()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        out = np.asarray(out, dtype=np.float32)
        n = len(batch["task"]) if "task" in batch else out.shape[0]
        if out.ndim != 3 or out.shape[0] != n:
            raise ValueError(f"policy.predict must return (B, H, A) or (B, K, 3) with B={n}, got shape {out.shape}")
        if self.kind == "waypoints" and out.shape[-1] != 3:
            raise ValueError(f"a waypoint policy must return (B, K, 3), got shape {out.shape}")
        if not np.all(np.isfinite(out)):
            raise ValueError("policy.predict returned non-finite values")
        return out

    @torch.inference_mode()
    def observe(self, obs: Mapping[str, Any]) -> None:
        """Feed the policy's temporal context on a step without a prediction (if it has one)."""
        if self.can_observe and self.has_context:
            self.policy.observe(to_policy_batch(obs))

    @property
    def ms_per_call(self) -> float:
        return 1000.0 * self.seconds / self.calls if self.calls else float("nan")


class PolicyActor:
    """A policy acting one step at a time over W envs: its chunks (or waypoint sets) run through
    the chunk executor, and it is asked again only for the rows whose chunk is spent (on every
    step with ``every_step``, so a temporal context sees every frame; otherwise the skipped steps'
    frames are only observed). ``act(obs, active)`` gives ``(W, *action)``; rows not in ``active``
    get zeros. ``first(obs)``, when given, makes the first prediction instead of the runner (to
    check what the policy returns, once)."""

    def __init__(self, runner: PolicyRunner, executor: Any, every_step: bool = False, first: Any = None):
        self.runner, self.executor, self.every_step, self._first = runner, executor, every_step, first

    def act(self, obs: Mapping[str, Any], active: np.ndarray | None = None) -> np.ndarray:
        width = len(obs["task"]) if "task" in obs else len(next(iter(obs.values())))
        had = self.executor.n_envs
        if self.executor.resize(width) and had:  # a new batch size: every row starts afresh
            self.runner.reset()
        active = np.arange(width) if active is None else np.asarray(active)
        needs = self.executor.needs()
        need = [int(r) for r in active if needs[r]]
        if need or self.every_step:
            pred = self.runner.predict(obs) if self._first is None else self._first(obs)
            self._first = None
            if need:
                self.executor.add(need, pred[need])
        else:
            self.runner.observe(obs)
        step = self.executor.next(active)
        actions = np.zeros((width, *step.shape[1:]), dtype=np.float32)
        actions[active] = step
        return actions

    def reset(self, rows: list[int] | None = None) -> None:
        self.executor.reset(rows)
        self.runner.reset(None if rows is not None and set(rows) >= set(range(self.executor.n_envs)) else rows)
