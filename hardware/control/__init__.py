"""The control node: fixed-rate loop, action scheduling, safety filter, faults and timing.

Names are imported on first use, so ``import hardware.control.chunking`` (the chunk executor the
learning side also runs) does not load the node and its transport.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Fault": "faults", "FaultLatch": "faults",
    "ControlNode": "node", "NodeConfig": "node",
    "NonFiniteCommand": "safety", "OutOfRangeCommand": "safety", "SafetyFilter": "safety", "UnsafeCommand": "safety",
    "ActionScheduler": "scheduler", "Chunk": "scheduler", "WaypointFollower": "scheduler",
    "ActionSource": "source", "PolicyWorkerSource": "source",
    "ChunkExecutor": "chunking",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hardware.control' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hardware.control.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
