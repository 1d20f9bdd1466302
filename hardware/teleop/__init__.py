"""Teleoperators behind one interface (:class:`Teleop`): lerobot's keyboard, gamepad and leader
arms wrapped, a scripted device, the :class:`SimOperator` model of a person; one
:class:`ActionAdapter` maps any device to a robot's action space and :class:`TeleopSource` makes
a device the control node's action source.

:func:`make_teleop` imports only what the chosen device needs (lerobot, and with it torch, only
for lerobot's devices).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from hardware.teleop.base import EVENTS, Teleop, TeleopDisconnected, TeleopError, TeleopReading

DEVICES = ("keyboard", "gamepad", "so101_leader", "so100_leader", "koch_leader", "web", "scripted", "phone")


def make_teleop(type: str, **kwargs: Any) -> Teleop:
    """``make_teleop("keyboard")``, ``make_teleop("so101_leader", port="/dev/ttyACM1", id="leader")``,
    ``make_teleop("scripted", script="session.json")``."""
    if type == "keyboard":
        from hardware.teleop.lerobot_devices import KeyboardTeleop

        return KeyboardTeleop(**kwargs)
    if type == "gamepad":
        from hardware.teleop.lerobot_devices import GamepadTeleop

        return GamepadTeleop(**kwargs)
    if type in ("so101_leader", "so100_leader", "koch_leader", "omx_leader"):
        from hardware.teleop.lerobot_devices import LeaderArmTeleop

        return LeaderArmTeleop(type, **kwargs)
    if type == "web":
        from hardware.teleop.web import WebTeleop

        return WebTeleop(**kwargs)
    if type == "scripted":
        from hardware.teleop.scripted import ScriptedTeleop

        return ScriptedTeleop(**kwargs)
    if type == "phone":
        missing = [m for m in ("hebi", "teleop") if importlib.util.find_spec(m) is None]
        raise TeleopError("lerobot's phone teleoperator needs the packages "
                          f"{missing or ['hebi', 'teleop']} (not installed); it is not offered here")
    raise TeleopError(f"unknown teleop device {type!r}; known: {DEVICES}")


def __getattr__(name: str):
    lazy = {"ActionAdapter": "adapter", "TeleopSource": "source", "SimOperator": "sim_operator",
            "OperatorStep": "sim_operator", "ScriptedTeleop": "scripted", "WebTeleop": "web"}
    if name not in lazy:
        raise AttributeError(f"module 'hardware.teleop' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hardware.teleop.{lazy[name]}"), name)


__all__ = ["DEVICES", "EVENTS", "Teleop", "TeleopDisconnected", "TeleopError", "TeleopReading", "make_teleop",
           "ActionAdapter", "TeleopSource", "SimOperator", "OperatorStep", "ScriptedTeleop"]
