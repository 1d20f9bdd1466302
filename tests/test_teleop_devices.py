"""Teleoperators: lerobot's keyboard and gamepad driven by synthetic event streams (their
listener / pygame replaced, lerobot's own key and button handling kept), the SO-101 leader over
the simulated motor bus, the adapter, and the errors a user sees."""

from __future__ import annotations

import sys
import threading
import types
from unittest.mock import patch

import numpy as np
import pytest

pytest.importorskip("lerobot.teleoperators")
# imported once here: patch.dict(sys.modules) below must not unload and re-register lerobot's configs
import lerobot.teleoperators.gamepad.teleop_gamepad  # noqa: E402,F401
import lerobot.teleoperators.keyboard.teleop_keyboard  # noqa: E402,F401

from hardware.drivers.base import DriverSpec  # noqa: E402
from hardware.drivers.sim_motor_bus import SimulatedMotorsBus  # noqa: E402
from hardware.teleop import ActionAdapter, TeleopDisconnected, TeleopError, TeleopReading, make_teleop  # noqa: E402


# -- keyboard ----------------------------------------------------------------------------------
class _Key:
    def __init__(self, char):
        self.char = char


class _FakeListener:
    """pynput's Listener as lerobot uses it: start / stop / is_alive, callbacks kept for the test."""

    instances: list = []

    def __init__(self, on_press, on_release):
        self.on_press, self.on_release = on_press, on_release
        self._alive = False
        _FakeListener.instances.append(self)

    def start(self):
        self._alive = True

    def stop(self):
        self._alive = False

    def is_alive(self):
        return self._alive


@pytest.fixture
def fake_pynput():
    fake = types.SimpleNamespace(Listener=_FakeListener, Key=types.SimpleNamespace(esc=object()))
    _FakeListener.instances.clear()
    with patch("lerobot.teleoperators.keyboard.teleop_keyboard.PYNPUT_AVAILABLE", True), \
            patch("lerobot.teleoperators.keyboard.teleop_keyboard.keyboard", fake):
        yield fake


def test_keyboard_maps_held_keys_and_presses_through_lerobots_listener(fake_pynput):
    kb = make_teleop("keyboard")
    kb.connect()
    listener = _FakeListener.instances[-1]
    listener.on_press(_Key("w"))
    listener.on_press(_Key("a"))
    listener.on_press(_Key("o"))
    r = kb.read()
    assert r.kind == "delta" and r.values["delta_x"] == 1.0 and r.values["delta_y"] == 1.0
    assert r.values["gripper"] == 2.0 and r.events == set()
    listener.on_release(_Key("w"))
    listener.on_press(_Key("n"))
    listener.on_release(_Key("n"))  # a press and release between two reads is still an event
    r = kb.read()
    assert r.values["delta_x"] == 0.0 and r.values["delta_y"] == 1.0
    assert r.events == {"save"}
    listener.on_press(_Key("r"))
    listener.on_press(_Key("i"))
    assert kb.read().events == {"rerecord", "toggle"}
    listener.on_release(fake_pynput.Key.esc)  # lerobot: Esc disconnects the listener
    with pytest.raises(TeleopDisconnected, match="Esc"):
        kb.read()


def test_keyboard_without_a_display_is_a_clear_error():
    with patch("lerobot.teleoperators.keyboard.teleop_keyboard.PYNPUT_AVAILABLE", False):
        kb = make_teleop("keyboard")
        with pytest.raises(TeleopError, match="needs a display.*headless"):
            kb.connect()


def test_unknown_and_unavailable_devices_are_clear_errors():
    with pytest.raises(TeleopError, match="unknown teleop device 'spacemouse'.*keyboard"):
        make_teleop("spacemouse")
    with pytest.raises(TeleopError, match="phone.*not installed"):
        make_teleop("phone")


# -- gamepad -----------------------------------------------------------------------------------
def _fake_pygame(axes, buttons, events, joysticks=1):
    present = {"count": joysticks}
    """A pygame stand-in: a joystick whose axes / buttons the test sets, an event queue it fills."""
    pg = types.ModuleType("pygame")
    pg.JOYBUTTONDOWN, pg.JOYBUTTONUP = 1539, 1540
    pg.error = RuntimeError

    class Joystick:
        def __init__(self, i):
            pass

        def init(self):
            pass

        def quit(self):
            pass

        def get_name(self):
            return "fake pad"

        def get_axis(self, i):
            return axes[i]

        def get_button(self, i):
            if buttons.get("unplugged"):
                raise pg.error("Joystick not initialized")
            return buttons.get(i, 0)

    pg.joystick = types.SimpleNamespace(init=lambda: None, get_count=lambda: present["count"], Joystick=Joystick,
                                        get_init=lambda: True, quit=lambda: None)
    pg.event = types.SimpleNamespace(get=lambda: [events.pop(0) for _ in range(len(events))])
    pg.init = pg.quit = lambda: None
    pg.present = present
    return pg


def test_gamepad_through_lerobots_controller_with_a_synthetic_event_stream():
    axes, buttons, events = [0.0] * 6, {}, []
    pg = _fake_pygame(axes, buttons, events)
    with patch.dict(sys.modules, {"pygame": pg}):
        pad = make_teleop("gamepad")
        pad.connect()
        axes[1], axes[3] = -0.8, 0.05  # stick forward; right stick inside the dead zone
        r = pad.read()
        assert r.values["delta_x"] == pytest.approx(0.8) and r.values["delta_z"] == 0.0
        assert r.values["gripper"] == 1.0 and r.events == set()
        buttons[5] = 1  # RB held: the operator takes over
        events.append(types.SimpleNamespace(type=pg.JOYBUTTONDOWN, button=7))  # open the gripper
        r = pad.read()
        assert "intervene" in r.events and r.values["gripper"] == 2.0
        buttons[5] = 0
        events.append(types.SimpleNamespace(type=pg.JOYBUTTONDOWN, button=3))  # Y: success
        assert pad.read().events == {"save", "success"}
        events.append(types.SimpleNamespace(type=pg.JOYBUTTONDOWN, button=0))  # X: re-record
        assert pad.read().events == {"rerecord"}
        buttons["unplugged"], pg.present["count"] = True, 0
        with pytest.raises(TeleopDisconnected, match="gamepad"):
            pad.read()


def test_gamepad_errors_say_what_is_missing():
    with patch.dict(sys.modules, {"pygame": None}):
        with pytest.raises(TeleopError, match="needs pygame"):
            make_teleop("gamepad").connect()
    with patch.dict(sys.modules, {"pygame": _fake_pygame([0.0] * 6, {}, [], joysticks=0)}):
        with pytest.raises(TeleopError, match="no gamepad detected"):
            make_teleop("gamepad").connect()


# -- SO-101 leader over the simulated bus -------------------------------------------------------
def test_so101_leader_reads_joint_positions_over_the_simulated_bus(tmp_path):
    with patch("lerobot.teleoperators.so_leader.so_leader.FeetechMotorsBus", SimulatedMotorsBus):
        leader = make_teleop("so101_leader", port="/dev/sim", id="leader", calibration_dir=str(tmp_path))
        leader.connect()
        bus = leader.device.bus
        assert not any(bus.torque.values())  # a leader is moved by hand: lerobot leaves its torque off
        bus.position.update(shoulder_pan=30.0, elbow_flex=-45.0, gripper=50.0)  # the person moves it
        r = leader.read()
        assert r.kind == "absolute" and r.events == set()
        assert r.values["shoulder_pan.pos"] == 30.0 and r.values["elbow_flex.pos"] == -45.0
        spec = DriverSpec("arm", tuple(f"j{i}" for i in range(6)), [-3.0] * 6, [3.0] * 6)
        deg = np.pi / 180
        adapter = ActionAdapter(spec, "joint", keys=leader.names, scale=[deg] * 5 + [1.745 / 100])
        cmd = adapter(r, None)
        np.testing.assert_allclose(cmd[[0, 2, 5]], [30 * deg, -45 * deg, 0.8725])
        bus.disconnect()  # the cable is pulled
        with pytest.raises(TeleopDisconnected, match="so101_leader"):
            leader.read()


# -- the adapter -------------------------------------------------------------------------------
def test_adapter_end_effector_deltas_move_the_tool_through_the_ik():
    from sim_envs.arm import so101
    from sim_envs.arm.ik import ArmIK

    spec = DriverSpec("arm", tuple(so101.JOINT_NAMES), so101.JOINT_LOW, so101.JOINT_HIGH)
    adapter = ActionAdapter(spec, "ee_delta", step=0.01, gripper_step=0.1)
    q = np.array([0.0, -0.3, 0.6, 0.4, 0.0, 0.5])
    ik = ArmIK()
    p0 = ik.fk(q)[0]
    q1 = adapter(TeleopReading({"delta_x": 1.0, "delta_y": 0.0, "delta_z": 0.0, "gripper": 2.0}), q)
    moved = ik.fk(q1)[0] - p0
    assert moved[0] == pytest.approx(0.01, abs=2e-3) and abs(moved[1]) < 2e-3 and abs(moved[2]) < 2e-3
    assert q1[5] == pytest.approx(0.6)
    q2 = adapter(TeleopReading({"delta_z": -1.0, "gripper": 0.0}), q1)
    assert ik.fk(q2)[0][2] < ik.fk(q1)[0][2] - 0.005 and q2[5] == pytest.approx(0.5)


def test_adapter_twist_and_mode_errors():
    base = DriverSpec("base", ("v", "omega"), [-1.0, -2.0], [1.0, 2.0])
    twist = ActionAdapter(base)
    np.testing.assert_allclose(twist(TeleopReading({"delta_x": 0.5, "delta_y": -1.0}), None), [0.5, -2.0])
    with pytest.raises(TeleopError, match="needs an arm"):
        ActionAdapter(base, "joint")
    arm = DriverSpec("arm", ("a", "b"), [-1, -1], [1, 1])
    with pytest.raises(TeleopError, match="absolute readings"):
        ActionAdapter(arm, "joint")(TeleopReading({"delta_x": 1.0}), None)


def test_teleop_layer_imports_neither_torch_nor_lerobot_nor_the_learning_side():
    import subprocess

    code = ("import sys, hardware.teleop, hardware.teleop.adapter, hardware.teleop.source, hardware.teleop.sim_operator, "
            "hardware.teleop.scripted, hardware.teleop.web; "
            "print('torch' in sys.modules, 'lerobot' in sys.modules, any(m.startswith('robopolicy') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False False False"
