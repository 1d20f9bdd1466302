"""Drivers: one per robot part. Simulated (MuJoCo, real time) or LeRobot robots.

:func:`make_driver` imports only what the chosen driver needs: the LeRobot adapter (which
pulls in torch through lerobot) is imported only when a ``lerobot`` driver is configured.
"""

from __future__ import annotations

from typing import Any

from hardware.drivers.base import Driver, DriverError, DriverSpec

DRIVER_TYPES = ("sim_arm", "sim_base", "lerobot")


def make_driver(type: str, **kwargs: Any) -> Driver:
    """``make_driver("sim_arm", env_id=..., seed=0)``, ``make_driver("lerobot", robot={...})``."""
    if type == "sim_arm":
        from hardware.drivers.sim_arm import SimArmDriver

        return SimArmDriver(**kwargs)
    if type == "sim_base":
        from hardware.drivers.sim_base import SimBaseDriver

        return SimBaseDriver(**kwargs)
    if type == "lerobot":
        from hardware.drivers.lerobot_robot import LeRobotDriver

        return LeRobotDriver(**kwargs)
    raise ValueError(f"unknown driver type {type!r}; known: {DRIVER_TYPES}")


__all__ = ["DRIVER_TYPES", "Driver", "DriverError", "DriverSpec", "make_driver"]
