"""Real-time layer: drivers, the control node, safety and the policy transport. No torch.

Sub-packages: :mod:`hardware.drivers` (one driver per robot part: simulated or LeRobot),
:mod:`hardware.control` (ControlNode, ActionScheduler, SafetyFilter, faults, clock) and
:mod:`hardware.transport` (ZeroMQ + msgpack messages to and from the policy worker).
Nothing is imported here, so ``import hardware.control`` stays small.
"""
