"""ScriptedTeleop: a device that replays readings (a dry run, a test, a recorded session).

A script is a list of steps ``{"values": {...}, "kind": "delta"|"absolute", "events": [...],
"repeat": N}``, read one per call (each step ``repeat`` times, events on its first read only);
``disconnect_after`` reads make the device vanish, as an unplugged one does. A JSON file holding
such a list is a script too (``--teleop scripted:FILE``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

from hardware.teleop.base import TeleopDisconnected, TeleopError, TeleopReading


class ScriptedTeleop:
    name = "scripted"

    def __init__(self, script: Sequence[dict] | str | Path, disconnect_after: int | None = None, loop: bool = False):
        if isinstance(script, (str, Path)):
            try:
                script = json.loads(Path(script).read_text())
            except (OSError, ValueError) as exc:
                raise TeleopError(f"scripted teleop: cannot read script {script}: {exc}") from None
        self.steps: list[TeleopReading] = []
        for i, step in enumerate(script):
            if not isinstance(step, dict) or "values" not in step:
                raise TeleopError(f"scripted teleop: step {i} needs a 'values' mapping")
            for r in range(int(step.get("repeat", 1))):
                events = set(step.get("events", ())) if r == 0 else set()
                self.steps.append(TeleopReading(dict(step["values"]), step.get("kind", "delta"), events))
        if not self.steps:
            raise TeleopError("scripted teleop: the script is empty")
        self.disconnect_after, self.loop = disconnect_after, bool(loop)
        self.index = 0
        self._connected = False

    @property
    def is_connected(self) -> bool:
        return self._connected

    def connect(self) -> None:
        self._connected = True

    def read(self, observation: dict[str, Any] | None = None) -> TeleopReading:
        if self.disconnect_after is not None and self.index >= self.disconnect_after:
            self._connected = False
        if not self._connected:
            raise TeleopDisconnected("scripted device unplugged")
        i = self.index % len(self.steps) if self.loop else min(self.index, len(self.steps) - 1)
        step = self.steps[i]
        events = step.events if (self.loop or self.index < len(self.steps)) else set()
        self.index += 1
        return TeleopReading(dict(step.values), step.kind, set(events), time.monotonic())

    def disconnect(self) -> None:
        self._connected = False
