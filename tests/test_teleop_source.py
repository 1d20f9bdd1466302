"""TeleopSource under the control node: an operator drives, takes over from a policy and gives
control back without a jump larger than the safety filter's step limit; a device that
disconnects stops the robot. SimOperator: delay, lapses, noise and its take-over rule."""

from __future__ import annotations

import numpy as np
import pytest

from hardware.control import ActionScheduler, ControlNode, NodeConfig, SafetyFilter
from hardware.teleop import ActionAdapter, ScriptedTeleop, SimOperator, TeleopSource
from test_hw_doubles import PointDriver, ScriptSource, wait_for

RATE, MAX_STEP = 200.0, 0.01


def _node(source, driver):
    safety = SafetyFilter(driver.spec, 1.0 / RATE, max_step=MAX_STEP)
    sent: list[tuple] = []
    scheduler = ActionScheduler("latest")

    def seen(obs, t, cmd):
        if cmd is not None:  # what was sent, who drove, when, and what the scheduler asked for then
            sent.append((cmd.copy(), source.intervening, t, scheduler.command_at(t)))

    node = ControlNode(driver, source, scheduler, safety, NodeConfig(rate_hz=RATE, fifo=False), on_observation=seen)
    return node, safety, sent


def test_handover_and_giveback_never_jump_more_than_the_step_limit():
    driver = PointDriver(3, RATE)
    driver.q[:] = 0.5  # the policy's plan holds 0.5: it never needs a clamp of its own
    policy = ScriptSource(lambda q, t: np.full((10, 3), 0.5), dt=0.05, every=0.05)
    # the operator's leader arm is held at -1 (far from the follower); 'toggle' takes over, then gives back
    script = [{"kind": "absolute", "values": {"j0": -1.0, "j1": -1.0, "j2": -1.0}, "repeat": 15},
              {"kind": "absolute", "values": {"j0": -1.0, "j1": -1.0, "j2": -1.0}, "events": ["toggle"], "repeat": 40},
              {"kind": "absolute", "values": {"j0": -1.0, "j1": -1.0, "j2": -1.0}, "events": ["toggle"], "repeat": 1}]
    device = ScriptedTeleop(script)
    adapter = ActionAdapter(driver.spec, "joint", keys=("j0", "j1", "j2"))
    source = TeleopSource(device, adapter, rate_hz=50.0, max_speed=MAX_STEP * RATE, policy=policy)
    node, safety, sent = _node(source, driver)
    node.start()
    try:
        assert wait_for(lambda: source.handovers >= 2 and device.index > 80, timeout=10)
        assert wait_for(lambda: abs(driver.q[0] - 0.5) < 1e-6, timeout=10)  # back on the policy's plan
    finally:
        node.close()
    assert node.fault is None
    cmds = np.array([s[0] for s in sent])
    flags = [s[1] for s in sent]
    assert any(flags) and not flags[0] and not flags[-1]
    assert cmds[:, 0].min() < -0.9  # the operator really drove the arm toward -1
    assert np.abs(np.diff(cmds, axis=0)).max() <= MAX_STEP + 1e-9  # what the robot got
    # what the hand-overs asked for: never faster than one step limit per nominal tick (a tick the
    # shared machine ran late spans more time, and so a proportionally larger step)
    ts = np.array([s[2] for s in sent])
    asked, held = [], sent[0][0]
    for s in sent:  # between chunks the node holds the last command
        held = s[3] if s[3] is not None else held
        asked.append(held)
    asked = np.array(asked)
    speed = np.abs(np.diff(asked, axis=0)).max(axis=1) / np.maximum(np.diff(ts), 1e-6)
    assert speed.max() <= MAX_STEP * RATE * (1 + 1e-3)


def test_a_device_that_disconnects_mid_episode_stops_the_robot():
    driver = PointDriver(3, RATE)
    adapter = ActionAdapter(driver.spec, "joint", keys=("j0", "j1", "j2"))
    device = ScriptedTeleop([{"kind": "absolute", "values": {"j0": 0.1, "j1": 0.0, "j2": 0.0}}], disconnect_after=10)
    source = TeleopSource(device, adapter, rate_hz=50.0)
    node, _, _ = _node(source, driver)
    node.start()
    try:
        assert wait_for(lambda: node.fault is not None, timeout=5)
    finally:
        node.close()
    assert node.fault.code == "source_silent" and "disconnected" in node.fault.reason
    assert "unplugged" in source.problem and driver.stops


class _LineOracle:
    """Oracle of a 1-D task: go to +1 at full speed."""

    class action_space:
        low, high, shape = np.array([-1.0]), np.array([1.0]), (1,)

    def reset(self, obs, info):
        pass

    def label(self, obs, info):
        class Step:
            pass

        s = Step()
        s.label = np.clip([1.0 - obs["x"]], -1, 1)
        return s


def _run_line(op, policy, steps):
    x, out = 0.0, []
    for _ in range(steps):
        st = op.step({"x": x}, {}, np.array([policy(x) if callable(policy) else policy]))
        x = x + 0.05 * float(st.action[0])
        out.append(st)
    return out


def test_sim_operator_takes_over_late_and_gives_back_when_the_policy_agrees():
    dt = 0.05
    op = SimOperator(_LineOracle(), dt, seed=0, reaction=(0.15, 0.30), noise=0.0, lapse_rate=0.0, patience=3)
    steps = _run_line(op, -1.0, 40)  # the policy drives away from the goal
    first = next(i for i, s in enumerate(steps) if s.intervening)
    # the rule triggers on the 3rd disagreeing step (index 2); the person reacts 3-6 steps later
    assert 2 + round(0.15 / dt) <= first <= 2 + round(0.30 / dt)
    assert all(not s.intervening for s in steps[:first]) and op.takeovers == 1
    assert steps[first].action[0] > 0 and steps[first].proposal[0] == -1.0
    op2 = SimOperator(_LineOracle(), dt, seed=0, noise=0.0, lapse_rate=0.0, min_drive_s=0.2)
    good = _run_line(op2, lambda x: 0.9 * np.clip(1.0 - x, -1, 1), 30)  # a policy that agrees with the oracle is never taken over
    assert not any(s.intervening for s in good)


def test_sim_operator_lapses_and_noise():
    dt = 0.05
    always_away = SimOperator(_LineOracle(), dt, seed=1, noise=0.0, lapse_rate=1e9, lapse_s=10.0)
    assert not any(s.intervening for s in _run_line(always_away, -1.0, 50))  # looking away the whole time
    assert always_away.lapses == 1
    noisy = SimOperator(_LineOracle(), dt, seed=2, noise=0.2, lapse_rate=0.0, max_drive_s=100.0)
    driving = [s for s in _run_line(noisy, -1.0, 60) if s.intervening]
    gaps = np.array([s.action[0] - s.label[0] for s in driving])
    assert len(driving) > 20 and gaps.std() > 0.05  # noisy actions, clean labels
    with pytest.raises(ValueError, match="reaction"):
        SimOperator(_LineOracle(), dt, reaction=(0.3, 0.1))
