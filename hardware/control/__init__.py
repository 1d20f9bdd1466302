"""The control node: fixed-rate loop, action scheduling, safety filter, faults and timing."""

from hardware.control.faults import Fault, FaultLatch
from hardware.control.node import ControlNode, NodeConfig
from hardware.control.safety import NonFiniteCommand, OutOfRangeCommand, SafetyFilter, UnsafeCommand
from hardware.control.scheduler import ActionScheduler, Chunk, WaypointFollower
from hardware.control.source import ActionSource, PolicyWorkerSource

__all__ = [
    "ActionScheduler", "ActionSource", "Chunk", "ControlNode", "Fault", "FaultLatch", "NodeConfig",
    "NonFiniteCommand", "OutOfRangeCommand", "UnsafeCommand", "PolicyWorkerSource", "SafetyFilter", "WaypointFollower",
]
