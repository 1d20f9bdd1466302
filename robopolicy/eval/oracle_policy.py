"""The task's privileged oracle as the policy under evaluation: ``robopolicy eval --checkpoint oracle``.

The oracle reads the env's privileged ``info``, which lives in the env worker, so it acts there
(:class:`robopolicy.eval.envs.OracleDrives` replaces each action with the oracle's); on this side
:class:`OraclePolicy` stands in for a checkpoint, and its zero actions are ignored. The episodes,
seeds, metrics and records are those of any other evaluation.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

ORACLE_CHECKPOINT = "oracle"
"""The ``checkpoint`` value that evaluates the task's oracle."""


class OraclePolicy:
    """Stands in for a checkpoint: predicts ``(B, 1, action_dim)`` zeros, which the env's oracle
    replaces. It reads no camera (the oracle acts on privileged state)."""

    output = "action"
    drives_with_oracle = True

    def __init__(self, action_dim: int):
        self.action_dim = int(action_dim)
        self.config = SimpleNamespace(cameras=[], env_state_dim=0)

    @classmethod
    def for_env(cls, env: Any) -> "OraclePolicy":
        """The stand-in for ``env`` (an ``EnvConfig``): its action size read from one env."""
        from robopolicy.eval.envs import single_spaces

        _, action_space = single_spaces(env)
        return cls(int(np.prod(action_space.shape)))

    def predict(self, batch: dict[str, Any]) -> np.ndarray:
        return np.zeros((len(batch["task"]), 1, self.action_dim), dtype=np.float32)

    def reset(self, rows: list[int] | None = None) -> None:
        pass

    def eval(self) -> "OraclePolicy":
        return self
