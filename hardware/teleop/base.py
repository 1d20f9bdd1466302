"""The teleoperator contract: one small interface for every device.

A device is connected, read at its own rate, and disconnected. Each :meth:`Teleop.read` gives a
:class:`TeleopReading`: the device's values by name (joint positions of a leader arm, or deltas
of a keyboard / gamepad / joystick, in the device's own units) and the button events since the
last read. What those values mean for a robot is the :class:`~hardware.teleop.adapter.ActionAdapter`'s
business, never the device's.

Event names (one vocabulary for every device; lerobot-record's episode controls):

* ``save`` — end the episode and keep it; ``rerecord`` — drop it and record it again;
  ``discard`` — drop it and go on; ``stop`` — keep what is committed and end the session;
* ``success`` / ``failure`` — the operator's mark of the episode (stored with it);
* ``intervene`` — held while the operator takes over from the policy; ``toggle`` flips the
  take-over of a device without a held button (a key press).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

EVENTS = ("save", "rerecord", "discard", "stop", "success", "failure", "intervene", "toggle")


class TeleopError(RuntimeError):
    """A teleoperator cannot be used (unknown device, missing display, package or hardware)."""


class TeleopDisconnected(TeleopError):
    """The device went away while it was in use."""


@dataclass
class TeleopReading:
    """One read of a device.

    ``values``: name -> value in the device's units; ``kind``: "absolute" (a leader arm's
    joint positions) or "delta" (a keyboard's or gamepad's motion, roughly in [-1, 1] per axis,
    ``gripper`` 0 close / 1 stay / 2 open, as lerobot's devices give it); ``events``: the
    :data:`EVENTS` seen since the last read; ``t``: time.monotonic() of the read.
    """

    values: dict[str, float]
    kind: str = "delta"
    events: set[str] = field(default_factory=set)
    t: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("absolute", "delta"):
            raise ValueError(f"reading kind must be 'absolute' or 'delta', got {self.kind!r}")
        unknown = set(self.events) - set(EVENTS)
        if unknown:
            raise ValueError(f"unknown teleop events {sorted(unknown)}; known: {EVENTS}")


class Teleop(Protocol):
    """A teleoperator. ``read`` may be given the robot's latest observation (a simulated
    operator looks at it; a human device ignores it)."""

    name: str

    def connect(self) -> None: ...

    def read(self, observation: dict[str, Any] | None = None) -> TeleopReading: ...

    def disconnect(self) -> None: ...

    @property
    def is_connected(self) -> bool: ...
