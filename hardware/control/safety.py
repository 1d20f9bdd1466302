"""SafetyFilter: every command passes here between the scheduler and the driver.

In order: non-finite values → fault (the command is refused, never "repaired"); a value far
outside the command bounds (``fault_spans`` times the bound's span beyond it, 3 by default) →
fault too: a policy that asks for 1e6 rad is broken, and clamping would drive the joint into its
limit; clamp to the
command bounds; clamp the change per tick (rate limit: joint velocity for an arm, acceleration
for a base) and the change of that change (joint acceleration / jerk); then the workspace box:
a command whose workspace point (e.g. the tool-centre point from forward kinematics) falls
outside the box is replaced by the previous safe command. Every clamp is counted by kind.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import numpy as np

from hardware.drivers.base import DriverSpec


class UnsafeCommand(ValueError):
    """A command refused outright (a fault, never clamped); ``code`` names the fault."""

    code = "unsafe_command"


class NonFiniteCommand(UnsafeCommand):
    """The command contains NaN or inf (or has the wrong shape): a fault, not something to clamp."""

    code = "non_finite"


class OutOfRangeCommand(UnsafeCommand):
    """A command value far outside the robot's range: a fault, not something to clamp."""

    code = "out_of_range"


class SafetyFilter:
    def __init__(
        self,
        spec: DriverSpec,
        dt: float,
        max_step: np.ndarray | float | None = None,
        workspace_low: np.ndarray | None = None,
        workspace_high: np.ndarray | None = None,
        workspace_point: Callable[[np.ndarray], np.ndarray] | None = None,
        fault_spans: float | None = 3.0,
    ):
        self.spec, self.dt = spec, float(dt)
        n = spec.dim
        self.low, self.high = spec.command_low, spec.command_high
        # Beyond these a command is a fault; a bound without a finite span gets no such limit.
        low, high = (np.broadcast_to(np.asarray(v, float), (n,)) for v in (self.low, self.high))
        span = high - low
        if fault_spans is not None and not float(fault_spans) >= 0:
            raise ValueError(f"fault_spans must be >= 0 (or None: never), got {fault_spans}")
        reach = (np.full(n, np.inf) if fault_spans is None
                 else np.where(np.isfinite(span), span * float(fault_spans), np.inf))
        self.fault_low, self.fault_high = low - reach, high + reach
        self.max_rate, self.max_rate2 = spec.max_rate, spec.max_rate2
        self.max_step = None if max_step is None else np.broadcast_to(np.asarray(max_step, float), (n,)).copy()
        if (workspace_low is None) != (workspace_high is None):
            raise ValueError("give both workspace_low and workspace_high, or neither")
        self.ws_low = None if workspace_low is None else np.asarray(workspace_low, float)
        self.ws_high = None if workspace_high is None else np.asarray(workspace_high, float)
        if self.ws_low is not None and workspace_point is None:
            raise ValueError("a workspace box needs workspace_point (command -> point)")
        self.workspace_point = workspace_point
        self.counts: Counter[str] = Counter()
        # State as Python floats: the fast path below reads it element by element, which for a
        # handful of joints is ~20x cheaper than numpy's per-call overhead.
        self._prev: list[float] | None = None  # the last command sent
        self._prev_delta: list[float] = [0.0] * n  # its change from the one before
        # Fast path: one pass that finds no limit binding (the common tick) instead of clamping
        # and comparing stage by stage; anything else (a binding limit, NaN, inf) takes the staged
        # path, which counts it.
        step = np.full(n, np.inf)
        if self.max_step is not None:
            step = np.minimum(step, self.max_step)
        if self.max_rate is not None:
            step = np.minimum(step, np.broadcast_to(np.asarray(self.max_rate, float) * self.dt, (n,)))
        acc = np.full(n, np.inf) if self.max_rate2 is None else np.broadcast_to(np.asarray(self.max_rate2, float) * self.dt * self.dt, (n,))
        self._limits = tuple(np.broadcast_to(np.asarray(v, float), (n,)).tolist() for v in (self.low, self.high, step, acc))
        self._fast = True  # tests compare against the staged path alone

    def low_at(self, j: int) -> float:
        return float(np.broadcast_to(np.asarray(self.low, float), (self.spec.dim,))[j])

    def high_at(self, j: int) -> float:
        return float(np.broadcast_to(np.asarray(self.high, float), (self.spec.dim,))[j])

    def reset(self, current: np.ndarray) -> None:
        """Start from ``current`` (arm: measured position; base: measured twist), at rest."""
        self._prev = np.asarray(current, dtype=np.float64).reshape(self.spec.dim).tolist()
        self._prev_delta = [0.0] * self.spec.dim

    def __call__(self, command: np.ndarray) -> np.ndarray:
        cmd = np.asarray(command, dtype=np.float64)
        if cmd.shape != (self.spec.dim,):
            self.counts["bad_shape"] += 1
            raise NonFiniteCommand(f"command shape {cmd.shape} != ({self.spec.dim},)")
        if self._fast and self._prev is not None and self.ws_low is None:
            c, deltas = cmd.tolist(), []
            low, high, step, acc = self._limits
            for x, lo, hi, p, s_, pd, a_ in zip(c, low, high, self._prev, step, self._prev_delta, acc):
                d = x - p
                # NaN and inf fail the bounds test, so they reach the staged path's check below
                if not (lo <= x <= hi) or d > s_ or d < -s_ or d - pd > a_ or pd - d > a_:
                    break
                deltas.append(d)
            else:  # no limit binds: the staged path would return cmd unchanged
                self._prev, self._prev_delta = c, deltas
                return cmd.copy()
        if not np.isfinite(cmd).all():
            self.counts["non_finite"] += 1
            raise NonFiniteCommand(f"non-finite command {cmd.tolist()}")
        far = (cmd < self.fault_low) | (cmd > self.fault_high)
        if far.any():
            self.counts["out_of_range"] += 1
            j = int(np.argmax(far))
            raise OutOfRangeCommand(f"command {cmd[j]:.6g} for {self.spec.names[j]!r} is far outside "
                                    f"[{self.low_at(j):.6g}, {self.high_at(j):.6g}] (fault beyond "
                                    f"[{self.fault_low[j]:.6g}, {self.fault_high[j]:.6g}])")
        out = np.clip(cmd, self.low, self.high)
        if not np.array_equal(out, cmd):
            self.counts["position" if self.spec.kind == "arm" else "command"] += 1
        if self._prev is None:
            self.reset(out)
            return out.copy()
        prev = np.array(self._prev)
        delta = out - prev
        if self.max_step is not None:
            d2 = np.clip(delta, -self.max_step, self.max_step)
            if not np.array_equal(d2, delta):
                self.counts["step"] += 1
            delta = d2
        if self.max_rate is not None:
            lim = self.max_rate * self.dt
            d2 = np.clip(delta, -lim, lim)
            if not np.array_equal(d2, delta):
                self.counts["velocity" if self.spec.kind == "arm" else "acceleration"] += 1
            delta = d2
        if self.max_rate2 is not None:
            lim = self.max_rate2 * self.dt * self.dt
            base = np.array(self._prev_delta)
            d2 = np.clip(delta, base - lim, base + lim)
            if not np.array_equal(d2, delta):
                self.counts["acceleration" if self.spec.kind == "arm" else "jerk"] += 1
            delta = d2
        out = np.clip(prev + delta, self.low, self.high)
        if self.ws_low is not None:
            p = self.workspace_point(out)
            if np.any(p < self.ws_low) or np.any(p > self.ws_high):
                self.counts["workspace"] += 1
                out = prev.copy()
        self._prev_delta = (out - prev).tolist()
        self._prev = out.tolist()
        return out.copy()
