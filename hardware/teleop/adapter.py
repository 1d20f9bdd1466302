"""ActionAdapter: a device's reading → a command in a robot's action space (one class, any device).

Modes:

* ``joint`` — absolute values (a leader arm) → joint targets: ``command = offset + scale * value``
  over the reading's ``keys`` in command order (degrees → radians, a gripper's 0..100 → its angle).
* ``ee_delta`` — deltas (keyboard, gamepad, a web joystick) → end-effector motion of an arm:
  ``delta_x/y/z`` (in [-1, 1]) × ``step`` metres per read, through the damped-least-squares IK of
  :class:`sim_envs.arm.ik.ArmIK` from the command in force; ``gripper`` 0 closes, 2 opens by
  ``gripper_step`` per read. ``units_per_rad`` converts when the robot's joints are not in
  radians (a lerobot follower in degrees: 180/pi).
* ``twist`` — deltas → a base twist ``(v, omega) = (v_max * delta_x, omega_max * delta_y)``.

Every command is clipped to the robot's command bounds; the safety filter downstream still
limits its rate.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from hardware.drivers.base import DriverSpec
from hardware.teleop.base import TeleopError, TeleopReading

MODES = ("joint", "ee_delta", "twist")
DELTA_KEYS = ("delta_x", "delta_y", "delta_z")


class ActionAdapter:
    def __init__(self, spec: DriverSpec, mode: str | None = None, keys: Sequence[str] | None = None,
                 scale: float | Sequence[float] = 1.0, offset: float | Sequence[float] = 0.0,
                 step: float = 0.005, gripper_step: float = 0.05, units_per_rad: float = 1.0,
                 v_max: float | None = None, omega_max: float | None = None):
        self.spec = spec
        self.mode = mode or ("twist" if spec.kind == "base" else "ee_delta")
        if self.mode not in MODES:
            raise TeleopError(f"unknown adapter mode {self.mode!r}; known: {MODES}")
        if self.mode == "twist" and spec.kind != "base":
            raise TeleopError("adapter mode 'twist' needs a base (the robot is an arm)")
        if self.mode != "twist" and spec.kind == "base":
            raise TeleopError(f"adapter mode {self.mode!r} needs an arm (the robot is a base)")
        n = spec.dim
        self.keys = None if keys is None else tuple(keys)
        if self.keys is not None and len(self.keys) != n:
            raise TeleopError(f"adapter keys name {len(self.keys)} values, the robot takes {n}")
        self.scale = np.broadcast_to(np.asarray(scale, float), (n,)).copy()
        self.offset = np.broadcast_to(np.asarray(offset, float), (n,)).copy()
        self.step, self.gripper_step, self.units_per_rad = float(step), float(gripper_step), float(units_per_rad)
        self.v_max = float(spec.command_high[0] if v_max is None else v_max)
        self.omega_max = float(spec.command_high[1] if omega_max is None and spec.kind == "base" else (omega_max or 0.0))
        self._ik = None
        if self.mode == "ee_delta":
            from sim_envs.arm.ik import ArmIK  # numpy + mujoco, no learning stack

            if n != 6:
                raise TeleopError(f"adapter mode 'ee_delta' drives the 5-joint + gripper arm; the robot has {n} values")
            self._ik = ArmIK()

    def __call__(self, reading: TeleopReading, current: np.ndarray | None) -> np.ndarray:
        """The command for ``reading``; ``current`` is the command in force (needed by delta modes)."""
        if self.mode == "joint":
            if reading.kind != "absolute":
                raise TeleopError("adapter mode 'joint' needs absolute readings (a leader arm)")
            keys = self.keys or tuple(reading.values)
            missing = [k for k in keys if k not in reading.values]
            if missing or len(keys) != self.spec.dim:
                raise TeleopError(f"the reading lacks {missing or keys} for the robot's {self.spec.dim} joints")
            raw = np.array([reading.values[k] for k in keys], float)
            cmd = self.offset + self.scale * raw
        elif self.mode == "twist":
            v = reading.values
            cmd = np.array([self.v_max * float(v.get("delta_x", 0.0)), self.omega_max * float(v.get("delta_y", 0.0))])
        else:
            if current is None:
                raise TeleopError("adapter mode 'ee_delta' needs the command in force")
            cmd = np.asarray(current, float).copy()
            d = np.array([float(reading.values.get(k, 0.0)) for k in DELTA_KEYS])
            d = np.clip(d, -1.0, 1.0) * self.step
            if np.any(d):
                q = cmd / self.units_per_rad
                q[:4] += self._ik.joint_shift(q, d)
                cmd[:4] = q[:4] * self.units_per_rad
            g = reading.values.get("gripper", 1.0)
            if math.isfinite(g) and g != 1.0:
                cmd[5] += (self.gripper_step if g > 1.0 else -self.gripper_step) * self.units_per_rad
        if not np.all(np.isfinite(cmd)):
            raise TeleopError(f"non-finite command from the device: {cmd.tolist()}")
        return np.clip(cmd, self.spec.command_low, self.spec.command_high)
