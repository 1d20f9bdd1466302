"""LeRobot adapters: lerobot's own SO-101 / Koch follower classes over a simulated motor bus.

The robot classes (connect, configure, get_observation, send_action with max_relative_target
clipping) are lerobot's; only the serial bus underneath is simulated (the Feetech/Dynamixel
SDKs are not installed here and there is no hardware), as lerobot's own robot tests do.
"""

from __future__ import annotations

from unittest.mock import patch

import numpy as np
import pytest

pytest.importorskip("lerobot.robots")

from hardware.control import ActionScheduler, ControlNode, NodeConfig, SafetyFilter  # noqa: E402
from hardware.drivers import make_driver  # noqa: E402
from hardware.drivers.sim_motor_bus import SimulatedMotorsBus  # noqa: E402
from test_hw_doubles import ScriptSource, wait_for  # noqa: E402


@pytest.fixture
def so101(tmp_path):
    with patch("lerobot.robots.so_follower.so_follower.FeetechMotorsBus", SimulatedMotorsBus):
        driver = make_driver("lerobot", robot={"type": "so101_follower", "port": "/dev/sim", "id": "test",
                                               "calibration_dir": str(tmp_path), "max_relative_target": 5.0},
                             rate_hz=100.0, command_low=[-100] * 6, command_high=[100] * 6)
        driver.connect()
        yield driver
        driver.disconnect()


def test_so101_adapter_reads_writes_and_reports_what_was_sent(so101):
    from lerobot.robots.so_follower import SO101Follower

    assert isinstance(so101.robot, SO101Follower) and so101.robot.is_connected
    assert so101.spec.names[0] == "shoulder_pan.pos" and so101.spec.dim == 6 and so101.spec.kind == "arm"
    obs = so101.read()
    assert obs["observation.state"].shape == (6,)
    sent = so101.write(np.full(6, 30.0))
    np.testing.assert_allclose(sent, 5.0)  # lerobot's max_relative_target clipped it; we get what was sent
    assert so101.robot.bus.goal["shoulder_pan"] == pytest.approx(5.0)
    assert wait_for(lambda: so101.read()["observation.state"][0] > 1.0)  # the simulated servo moves
    so101.stop()
    held = so101.read()["observation.state"]
    assert so101.robot.bus.goal["elbow_flex"] == pytest.approx(held[2], abs=0.5)


def test_so101_adapter_under_the_control_node(so101):
    src = ScriptSource(lambda q, t: np.tile(np.linspace(0, 20, 10)[:, None], (1, 6)), dt=0.05, every=0.1)
    node = ControlNode(so101, src, ActionScheduler("latest"), SafetyFilter(so101.spec, 0.01), NodeConfig(fifo=False))
    node.start()
    try:
        assert wait_for(lambda: so101.robot.bus.writes > 20)
        assert node.fault is None
        node.estop("test")
        assert wait_for(lambda: node.fault is not None)
        assert node.fault.stop_latency < 0.1
    finally:
        node.close()


def test_koch_adapter(tmp_path):
    with patch("lerobot.robots.koch_follower.koch_follower.DynamixelMotorsBus", SimulatedMotorsBus):
        driver = make_driver("lerobot", robot={"type": "koch_follower", "port": "/dev/sim", "id": "k",
                                               "calibration_dir": str(tmp_path)})
        driver.connect()
        try:
            assert driver.spec.dim == 6
            np.testing.assert_allclose(driver.write(np.full(6, 3.0)), 3.0)
            assert driver.read()["observation.state"].shape == (6,)
        finally:
            driver.disconnect()
