"""A policy learnt from scratch: an actor-critic over the whole action (PPO from scratch, a compact
RPD student).

    policy = ScratchPolicy(ResidualConfig(inputs=["state"], hidden=[64, 64]), action_low, action_high, state_dim=6)
    chunk = policy.predict(obs)            # (B, chunk, A): the actor's mean in env units
    policy.save("outputs/refine/ppo")      # config.yaml (type: residual, no base) + residual.safetensors
    policy = load_policy("outputs/refine/ppo")   # robopolicy.models.load_policy

Its settings are a :class:`~robopolicy.refine.residual.ResidualConfig`'s (the ``residual`` /
``student`` keys of the refine configs) without those that act over a base (``features``,
``base_action`` and ``base_tcp`` inputs, ``tcp``, ``switch_dims``, ``decision: chunk``). The
actor's sample is the action itself, ``a = unnorm(clip(r, -1, 1))``; with ``chunk`` > 1 the actor
outputs ``chunk`` actions per decision, executed open loop. The refinement loops drive it through
the surface it shares with the residual (:class:`~robopolicy.refine.residual.ActorCriticPolicy`);
its checkpoint is a residual checkpoint without ``base/``, so one saved before this class existed
loads as one.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from robopolicy.refine.residual import ActorCriticPolicy, ResidualConfig, _batch_size, _check_base


class ScratchPolicy(ActorCriticPolicy):
    """An actor-critic policy over the whole action (see the module docstring)."""

    def __init__(self, config: ResidualConfig, action_low: Sequence[float], action_high: Sequence[float],
                 state_dim: int = 0, env_state_dim: int = 0):
        super().__init__()
        a = len(action_low)
        _check_base(config, None, a)
        self.base = None  # the loops and ``init_from`` ask whether a policy acts over a base
        sizes = {"state": state_dim, "features": 0, "base_action": a, "base_tcp": 3,
                 "environment_state": env_state_dim, "time": 1}
        self._build(config, action_low, action_high, sizes, torch.ones(a))

    def reset(self, rows: Sequence[int] | None = None) -> None:
        """Restart the step count (the ``time`` input) of every row: the count was kept per batch,
        not per row, when this role lived in the residual, and runs keep that behaviour."""
        self._reset_elapsed(None)

    def base_actions(self, obs: Mapping[str, Any], peek: bool = False) -> tuple[torch.Tensor, None]:
        """The action box's centre ``(B, A)``, which the sample moves (every row decides every step)."""
        b = _batch_size(obs)
        if not peek:
            self.fresh = torch.ones(b, dtype=torch.bool)
        return self.action_loc.expand(b, -1).clone(), None
