"""A simulated motor bus with lerobot's MotorsBus interface, for running lerobot robots without
hardware (dry runs, tests): each motor's Present_Position follows its Goal_Position as a
first-order lag with a speed limit, in the bus's normalized units.

Install it in place of the robot's real bus before the robot is built, e.g.
``unittest.mock.patch("lerobot.robots.so_follower.so_follower.FeetechMotorsBus", SimulatedMotorsBus)``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from lerobot.motors.motors_bus import MotorCalibration, MotorsBusBase


class SimulatedMotorsBus(MotorsBusBase):
    def __init__(self, port: str, motors: dict, calibration: dict | None = None, time_constant: float = 0.05,
                 max_speed: float = 200.0, **_):
        super().__init__(port, motors, calibration)
        self.tau, self.max_speed = float(time_constant), float(max_speed)
        self._connected = False
        self.torque = {m: False for m in motors}
        self.position = {m: 0.0 for m in motors}
        self.goal = {m: 0.0 for m in motors}
        self.registers: dict[tuple[str, str], float] = {}
        self._t = time.monotonic()
        self.writes = 0

    @property
    def is_connected(self) -> bool:
        return self._connected

    @property
    def is_calibrated(self) -> bool:
        return True

    def connect(self, handshake: bool = True) -> None:
        self._connected = True
        self._t = time.monotonic()

    def disconnect(self, disable_torque: bool = True) -> None:
        if disable_torque:
            self.disable_torque()
        self._connected = False

    def _advance(self) -> None:
        now = time.monotonic()
        dt, self._t = now - self._t, now
        for m in self.motors:
            if self.torque[m]:
                err = self.goal[m] - self.position[m]
                step = err * min(1.0, dt / self.tau)
                lim = self.max_speed * dt
                self.position[m] += max(-lim, min(lim, step))

    def _need(self) -> None:
        if not self._connected:
            raise ConnectionError(f"{self.port}: simulated bus not connected")

    def read(self, data_name: str, motor: str):
        self._need()
        self._advance()
        if data_name == "Present_Position":
            return self.position[motor]
        if data_name == "Goal_Position":
            return self.goal[motor]
        return self.registers.get((data_name, motor), 0)

    def write(self, data_name: str, motor: str, value) -> None:
        self._need()
        self.sync_write(data_name, {motor: value})

    def sync_read(self, data_name: str, motors=None) -> dict:
        self._need()
        names = self.motors if motors is None else ([motors] if isinstance(motors, str) else motors)
        return {m: self.read(data_name, m) for m in names}

    def sync_write(self, data_name: str, values: dict) -> None:
        self._need()
        self._advance()
        for m, v in values.items():
            if data_name == "Goal_Position":
                self.goal[m] = float(v)
                self.writes += 1
            elif data_name == "Torque_Enable":
                self.torque[m] = bool(v)
            else:
                self.registers[(data_name, m)] = v

    def enable_torque(self, motors=None, num_retry: int = 0) -> None:
        for m in self.motors if motors is None else ([motors] if isinstance(motors, str) else motors):
            self.torque[m] = True

    def disable_torque(self, motors=None, num_retry: int = 0) -> None:
        for m in self.motors if motors is None else ([motors] if isinstance(motors, str) else motors):
            self.torque[m] = False

    @contextmanager
    def torque_disabled(self, motors=None):
        self.disable_torque(motors)
        try:
            yield
        finally:
            self.enable_torque(motors)

    def configure_motors(self, *args, **kwargs) -> None:
        pass

    def read_calibration(self) -> dict[str, MotorCalibration]:
        return dict(self.calibration)

    def write_calibration(self, calibration_dict: dict[str, MotorCalibration], cache: bool = True) -> None:
        if cache:
            self.calibration = calibration_dict
