"""LeRobotDriver: any ``lerobot`` Robot (so101_follower, koch_follower, lekiwi_client, ...) as a driver.

The robot is built from lerobot's own config (``robot: {type: so101_follower, port: ..., ...}``
is decoded by draccus into lerobot's RobotConfig, so every lerobot option passes through).
Command and state are the robot's ``action_features`` in order (e.g. ``shoulder_pan.pos``,
...; ``x.vel`` for a base), in lerobot's units. lerobot imports torch, so this module is only
imported when a ``lerobot`` driver is configured (see :func:`hardware.drivers.make_driver`).
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from hardware.drivers.base import DriverError, DriverSpec


def make_lerobot_robot(robot: dict[str, Any]):
    """A lerobot Robot from a plain mapping with a ``type`` key (lerobot's config, passed through)."""
    import draccus

    from lerobot.robots import RobotConfig, make_robot_from_config

    if "type" not in robot:
        raise DriverError("lerobot robot config needs a 'type' (e.g. so101_follower, koch_follower)")
    _import_robot_configs(robot["type"])
    config = draccus.decode(RobotConfig, dict(robot))
    return make_robot_from_config(config)


def _import_robot_configs(robot_type: str) -> None:
    """lerobot registers a robot's config class when its package is imported."""
    import importlib

    package = {"so101_follower": "so_follower", "so100_follower": "so_follower", "lekiwi_client": "lekiwi"}.get(robot_type, robot_type)
    try:
        importlib.import_module(f"lerobot.robots.{package}")
    except ImportError:
        pass  # draccus will name the unknown type


class LeRobotDriver:
    """Wraps ``robot`` (a lerobot Robot, or the mapping for :func:`make_lerobot_robot`)."""

    def __init__(
        self,
        robot: Any,
        rate_hz: float = 100.0,
        command_low: Sequence[float] | None = None,
        command_high: Sequence[float] | None = None,
        max_velocity: float | Sequence[float] | None = None,
        max_acceleration: float | Sequence[float] | None = None,
        command_timeout: float = 0.5,
        calibrate: bool = False,
    ):
        self.robot = make_lerobot_robot(robot) if isinstance(robot, dict) else robot
        self.calibrate = bool(calibrate)
        self.keys = tuple(self.robot.action_features)
        n = len(self.keys)
        is_base = any(k.endswith(".vel") for k in self.keys) and not any(k.endswith(".pos") for k in self.keys)
        low = np.full(n, -np.inf) if command_low is None else np.asarray(command_low, float)
        high = np.full(n, np.inf) if command_high is None else np.asarray(command_high, float)
        self.spec = DriverSpec(
            kind="base" if is_base else "arm",
            names=self.keys,
            command_low=low,
            command_high=high,
            max_rate=max_velocity,
            max_rate2=max_acceleration,
            command_timeout=command_timeout,
            rate_hz=rate_hz,
            cameras=tuple(k for k, v in self.robot.observation_features.items() if isinstance(v, tuple)),
        )
        self._lock = threading.Lock()  # lerobot buses are not thread-safe; stop() may come from the watchdog
        self._last_state: np.ndarray | None = None

    def connect(self) -> None:
        self.robot.connect(calibrate=self.calibrate)

    def disconnect(self) -> None:
        with self._lock:
            if self.robot.is_connected:
                self.robot.disconnect()

    def read(self) -> dict[str, Any]:
        with self._lock:
            raw = self.robot.get_observation()
        missing = [k for k in self.keys if k not in raw]
        if missing:
            raise DriverError(f"observation lacks {missing}")
        state = np.array([float(raw[k]) for k in self.keys])
        self._last_state = state
        obs: dict[str, Any] = {"observation.state": state}
        for cam in self.spec.cameras:
            if cam in raw:
                obs[f"observation.images.{cam}"] = np.asarray(raw[cam])
        return obs

    def write(self, command: np.ndarray) -> np.ndarray:
        action = {k: float(v) for k, v in zip(self.keys, np.asarray(command, dtype=np.float64))}
        with self._lock:
            sent = self.robot.send_action(action)
        return np.array([float(sent.get(k, action[k])) for k in self.keys])

    def stop(self) -> None:
        """Hold the last read positions; zero every velocity command."""
        action = {}
        last = self._last_state
        for i, k in enumerate(self.keys):
            if k.endswith(".vel"):
                action[k] = 0.0
            elif last is not None:
                action[k] = float(last[i])
        if not action:
            return
        if not self._lock.acquire(timeout=0.05):
            raise DriverError("bus busy: could not send the safe stop (the loop is stuck inside the driver)")
        try:
            if self.robot.is_connected:
                self.robot.send_action(action)
        finally:
            self._lock.release()
