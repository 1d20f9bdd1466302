"""The driver contract: one driver owns one robot part (see DESIGN.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


class DriverError(RuntimeError):
    """A driver could not do what was asked (not connected, bus error, bad command)."""


@dataclass
class DriverSpec:
    """Names and limits of one robot part's command vector.

    kind: "arm" (command = joint positions) or "base" (command = twist ``(v, omega)``).
    command_low/high: bounds of the command itself (joint position or twist limits).
    max_rate: largest change of the command per second (arm: joint velocity, base:
        acceleration); None = unlimited.
    max_rate2: largest change of that rate per second (arm: acceleration, base: jerk).
    command_timeout: seconds without a fresh command before the watchdog trips.
    rate_hz: the rate the node should tick at for this part.
    """

    kind: str
    names: tuple[str, ...]
    command_low: np.ndarray
    command_high: np.ndarray
    max_rate: np.ndarray | None = None
    max_rate2: np.ndarray | None = None
    command_timeout: float = 0.5
    rate_hz: float = 500.0
    cameras: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("arm", "base"):
            raise ValueError(f"driver kind must be 'arm' or 'base', got {self.kind!r}")
        n = len(self.names)
        self.command_low = np.asarray(self.command_low, dtype=np.float64).reshape(n)
        self.command_high = np.asarray(self.command_high, dtype=np.float64).reshape(n)
        if not np.all(self.command_low <= self.command_high):
            raise ValueError("command_low must be <= command_high")
        for name in ("max_rate", "max_rate2"):
            val = getattr(self, name)
            if val is not None:
                arr = np.broadcast_to(np.asarray(val, dtype=np.float64), (n,)).copy()
                if not np.all(arr > 0):
                    raise ValueError(f"{name} must be > 0")
                setattr(self, name, arr)

    @property
    def dim(self) -> int:
        return len(self.names)


@runtime_checkable
class Driver(Protocol):
    """One robot part. ``read``/``write`` are called from the control thread each tick;
    ``stop`` may be called from any thread at any time (watchdog, e-stop) and must be
    idempotent and never raise for a connected driver."""

    spec: DriverSpec

    def connect(self) -> None: ...

    def read(self) -> dict[str, Any]:
        """``{"observation.state": (A,) float, "observation.images.<cam>": (H, W, 3) uint8, ...}``"""
        ...

    def write(self, command: np.ndarray) -> np.ndarray:
        """Send a command; returns the command actually sent (after the driver's own clipping)."""
        ...

    def stop(self) -> None:
        """Safe stop: arm holds its present position, base commands zero twist."""
        ...

    def disconnect(self) -> None: ...
