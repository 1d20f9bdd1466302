"""lerobot's own teleoperators behind :class:`~hardware.teleop.base.Teleop`.

The device I/O is lerobot's (``KeyboardTeleop``'s pynput listener, ``GamepadTeleop``'s pygame
controller, the leader arms' motor buses); these classes only turn what lerobot returns into a
:class:`TeleopReading` with our event names, and turn lerobot's silent failures (no display, no
gamepad, a bus that stops answering) into errors that say what happened. lerobot imports
torch, so this module is only imported when such a device is asked for
(:func:`hardware.teleop.make_teleop`).
"""

from __future__ import annotations

import time
from typing import Any

from hardware.teleop.base import TeleopDisconnected, TeleopError, TeleopReading

# key -> (axis, sign) of the motion keys; keys -> event; held gripper keys
KEY_AXES = {"w": ("delta_x", 1.0), "s": ("delta_x", -1.0), "a": ("delta_y", 1.0), "d": ("delta_y", -1.0),
            "u": ("delta_z", 1.0), "j": ("delta_z", -1.0)}
KEY_GRIPPER = {"o": 2.0, "c": 0.0}  # held: open / close (lerobot's 0 close, 1 stay, 2 open)
KEY_EVENTS = {"n": "save", "r": "rerecord", "x": "discard", "t": "stop", "g": "success", "b": "failure",
              "i": "toggle"}


class KeyboardTeleop:
    """The local keyboard through lerobot's ``KeyboardTeleop`` (a pynput listener; needs a display).

    Held keys move (w/s: x, a/d: y, u/j: z; o/c: open/close the gripper); a press is an event
    (n save, r re-record, x discard, t stop, g/b mark good/bad, i take over / give back).
    Esc stops lerobot's listener: the device is then disconnected.
    """

    name = "keyboard"

    def __init__(self, axes: dict | None = None, events: dict | None = None, gripper: dict | None = None):
        from lerobot.teleoperators.keyboard import KeyboardTeleop as LeKeyboard, KeyboardTeleopConfig

        self.axes = dict(KEY_AXES if axes is None else axes)
        self.events = dict(KEY_EVENTS if events is None else events)
        self.gripper = dict(KEY_GRIPPER if gripper is None else gripper)
        self.device = LeKeyboard(KeyboardTeleopConfig(id="robopolicy"))
        self._connected = False

    @property
    def is_connected(self) -> bool:
        return self._connected and self.device.is_connected

    def connect(self) -> None:
        from lerobot.teleoperators.keyboard import teleop_keyboard

        if not teleop_keyboard.PYNPUT_AVAILABLE:
            raise TeleopError("the keyboard teleoperator needs a display (lerobot's pynput listener could not "
                              "start: DISPLAY is unset or no X server answers); on a headless machine use "
                              "--teleop web (a page in a browser), gamepad or so101_leader")
        self.device.connect()
        if not self.device.is_connected:
            raise TeleopError("the keyboard listener did not start")
        self._connected = True

    def read(self, observation: dict[str, Any] | None = None) -> TeleopReading:
        if not self.is_connected:
            raise TeleopDisconnected("keyboard listener stopped (Esc pressed, or the display went away)")
        queue = self.device.event_queue
        with queue.mutex:  # the presses since the last read; get_action below drains the same queue
            presses = [k for k, down in queue.queue if down]
        pressed = self.device.get_action()  # lerobot: {key: None} for every key held now
        values = {"delta_x": 0.0, "delta_y": 0.0, "delta_z": 0.0, "gripper": 1.0}
        for key in pressed:
            if key in self.axes:
                axis, sign = self.axes[key]
                values[axis] += sign
            if key in self.gripper:
                values["gripper"] = self.gripper[key]
        events = {self.events[k] for k in presses if k in self.events}
        return TeleopReading(values, "delta", events, time.monotonic())

    def disconnect(self) -> None:
        if self.device.is_connected:
            self.device.disconnect()
        self._connected = False


class GamepadTeleop:
    """A gamepad through lerobot's ``GamepadTeleop`` (pygame): left stick x/y, right stick z,
    buttons 6/7 close/open the gripper, RB (5) held = take over, Y success / A failure (each
    ends the episode, marked) / X re-record."""

    name = "gamepad"

    def __init__(self, use_gripper: bool = True):
        from lerobot.teleoperators.gamepad.configuration_gamepad import GamepadTeleopConfig
        from lerobot.teleoperators.gamepad.teleop_gamepad import GamepadTeleop as LeGamepad

        self.device = LeGamepad(GamepadTeleopConfig(id="robopolicy", use_gripper=use_gripper))

    @property
    def is_connected(self) -> bool:
        return self.device.is_connected and getattr(self.device.gamepad, "joystick", None) is not None

    def connect(self) -> None:
        try:
            import pygame  # noqa: F401
        except ImportError:
            raise TeleopError("the gamepad teleoperator needs pygame (pip install pygame)") from None
        self.device.connect()
        if getattr(self.device.gamepad, "joystick", None) is None:
            self.device.disconnect()
            raise TeleopError("no gamepad detected (pygame sees no joystick)")

    def read(self, observation: dict[str, Any] | None = None) -> TeleopReading:
        from lerobot.teleoperators.utils import TeleopEvents

        if not self.is_connected:
            raise TeleopDisconnected("gamepad not connected")
        import pygame

        # lerobot reads a missing pad's axes as zeros (pygame.error is swallowed): ask pygame first
        if pygame.joystick.get_count() == 0:
            raise TeleopDisconnected("gamepad unplugged (pygame sees no joystick)")
        try:
            action = self.device.get_action()
            flags = self.device.get_teleop_events()
        except Exception as exc:  # pygame.error and friends: the pad went away
            raise TeleopDisconnected(f"gamepad stopped answering: {exc!r}") from exc
        values = {k: float(v) for k, v in action.items()}
        events: set[str] = set()
        if flags[TeleopEvents.IS_INTERVENTION]:
            events.add("intervene")
        if flags[TeleopEvents.RERECORD_EPISODE]:
            events.add("rerecord")
        elif flags[TeleopEvents.SUCCESS]:
            events |= {"save", "success"}
        elif flags[TeleopEvents.TERMINATE_EPISODE]:
            events |= {"save", "failure"}
        return TeleopReading(values, "delta", events, time.monotonic())

    def disconnect(self) -> None:
        self.device.disconnect()


LEADER_PACKAGES = {"so101_leader": "so_leader", "so100_leader": "so_leader", "koch_leader": "koch_leader",
                   "omx_leader": "omx_leader"}


class LeaderArmTeleop:
    """A leader arm (``so101_leader``, ``so100_leader``, ``koch_leader``, ...) through lerobot's own
    class: absolute joint positions in lerobot's units (``shoulder_pan.pos`` ..., degrees with
    ``use_degrees``, gripper 0..100). ``config`` is lerobot's teleoperator config as a mapping
    (``port``, ``id``, ``calibration_dir``, ...), decoded by draccus like the follower drivers'."""

    def __init__(self, type: str = "so101_leader", calibrate: bool = False, **config: Any):
        import importlib

        import draccus
        from lerobot.teleoperators import TeleoperatorConfig, make_teleoperator_from_config

        if type not in LEADER_PACKAGES:
            raise TeleopError(f"unknown leader arm {type!r}; known: {sorted(LEADER_PACKAGES)}")
        importlib.import_module(f"lerobot.teleoperators.{LEADER_PACKAGES[type]}")  # registers its config
        self.name = type
        self.calibrate = bool(calibrate)
        self.device = make_teleoperator_from_config(draccus.decode(TeleoperatorConfig, {"type": type, **config}))

    @property
    def is_connected(self) -> bool:
        return self.device.is_connected

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.device.action_features)

    def connect(self) -> None:
        try:
            self.device.connect(calibrate=self.calibrate)
        except Exception as exc:
            raise TeleopError(f"{self.name}: could not connect: {exc}") from exc

    def read(self, observation: dict[str, Any] | None = None) -> TeleopReading:
        if not self.device.is_connected:
            raise TeleopDisconnected(f"{self.name}: bus not connected")
        try:
            action = self.device.get_action()
        except Exception as exc:
            raise TeleopDisconnected(f"{self.name}: reading the leader failed: {exc!r}") from exc
        return TeleopReading({k: float(v) for k, v in action.items()}, "absolute", set(), time.monotonic())

    def disconnect(self) -> None:
        if self.device.is_connected:
            self.device.disconnect()
