"""Action adapters: how a residual sample ``r`` changes the base's command, one kind each.

Actions are in normalized units (the env's action box mapped to [-1, 1]) unless said otherwise.
Each adapter owns some action dimensions and says, for the clipped likelihood, where its samples
stop having an effect (``bounds``: ``±inf`` where they never do).

- :class:`JointOffset`: ``a = base + scale * r`` (a joint-space shift; the whole action without a base);
- :class:`GripperSwitch`: a categorical choice of keep / low end / high end per switch dimension;
- :class:`ToolPointOffset`: dimensions 0-2 move the base's commanded tool-centre point in metres,
  turned into joint changes by the arm's Jacobian.

Shapes: ``base_norm (B, A)``; ``r (B, A)``, or ``(B, k * A)`` for a chunk actor (offset only).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

TCP_ARMS = ("so101",)  # arms whose kinematics a ToolPointOffset can use


class JointOffset:
    """``a = base_norm + scale * r`` on the dimensions it ``moves`` (``(A,)`` bool), ``scale (A,)``."""

    def __init__(self, scale: torch.Tensor, moves: torch.Tensor):
        self.scale, self.moves = scale, moves

    def apply(self, base_norm: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """Normalized actions before the box's clip: ``(B, A)``, or ``(B, k, A)`` for ``r (B, k * A)``."""
        if r.shape[-1] != base_norm.shape[-1]:  # a chunk actor: k actions per sample
            r, base_norm = r.reshape(r.shape[0], -1, base_norm.shape[-1]), base_norm[:, None]
        return base_norm + self.scale * torch.where(self.moves, r, 0.0)

    def bounds(self, base_norm: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` ``(B, k * A)``: the samples beyond which the box clips (``±inf`` where this
        adapter moves nothing: a dimension it does not own, or one of scale 0)."""
        base = base_norm.repeat(1, k)
        scale = self.scale.repeat(k).expand_as(base)
        boxed = (scale > 0) & self.moves.repeat(k).expand_as(base)
        safe = scale.clamp(min=1e-12)
        lo, hi = (-1.0 - base) / safe, (1.0 - base) / safe
        return torch.where(boxed, lo, -torch.inf), torch.where(boxed, hi, torch.inf)


class GripperSwitch:
    """Per switch dimension (e.g. ``[5]``, an arm's gripper), setting 0 keeps the base's command,
    1 commands the box's low end, 2 its high end (e.g. closed / open). A gripper is binary in
    effect: a small Gaussian correction never opens a closed one, and one large enough to do so
    opens it anywhere; a switch explores by rare, whole changes and keeps the base's otherwise."""

    def __init__(self, dims: Sequence[int]):
        self.dims = list(dims)

    def apply(self, base_norm: torch.Tensor, r: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """``a (B, A)`` with each switch dimension set as ``r``'s setting index there says."""
        choice = r[:, self.dims].round().long().clamp(0, 2)
        ends = torch.ones_like(choice, dtype=a.dtype)
        options = torch.stack([base_norm[:, self.dims], -ends, ends], dim=-1)
        a = a.clone()
        a[:, self.dims] = options.gather(-1, choice[..., None]).squeeze(-1)
        return a


class ToolPointOffset:
    """Residual dimensions 0-2 move the base's commanded tool-centre point by ``scale[i] * r_i``
    metres along world x, y, z (clamped to ``±bound`` first when ``bound`` > 0), turned into a
    change of the first four joints by the Jacobian at the base's command (damped least squares).
    A base that grasps a centimetre off needs one consistent xy shift, which in joint space is a
    configuration-dependent mix of four joints."""

    DIMS = 3

    def __init__(self, arm: str, scale: torch.Tensor, bound: float = 0.0):
        if arm not in TCP_ARMS:
            raise ValueError(f"tool-point offset: unknown arm {arm!r} (choose from {sorted(TCP_ARMS)})")
        self.arm, self.scale, self.bound = arm, scale[:self.DIMS], float(bound)
        self._ik: Any = None  # the arm's kinematics, built on first use

    def kinematics(self):
        if self._ik is None:
            from sim_envs.arm.ik import ArmIK

            self._ik = ArmIK()
        return self._ik

    def command_tcp(self, base_act: torch.Tensor) -> torch.Tensor:
        """``(B, 3)``: the tool-centre point (m) of each row's commanded arm joints (env units)."""
        q = base_act[:, :5].detach().cpu().double().numpy()
        return torch.as_tensor(np.stack([self.kinematics().fk(row)[0] for row in q]), dtype=torch.float32)

    def apply(self, action: torch.Tensor, base_act: torch.Tensor, r: torch.Tensor, low: torch.Tensor,
              high: torch.Tensor) -> torch.Tensor:
        """``action (B, A)`` (env units) with the first four joints moved so that the tool-centre point
        of ``base_act``'s command moves by the offset, then kept inside ``[low, high]``."""
        offset = r[:, :self.DIMS].clamp(-self.bound, self.bound) if self.bound > 0 else r[:, :self.DIMS]
        delta = (self.scale * offset).detach().cpu().double().numpy()
        rows = np.flatnonzero(np.abs(delta).sum(1) > 0)
        if len(rows) == 0:
            return action
        q_base = base_act.detach().cpu().double().numpy()
        shift = np.zeros((action.shape[0], 4))
        for i in rows:
            shift[i] = self.kinematics().joint_shift(q_base[i, :5], delta[i])
        out = action.clone()
        out[:, :4] += torch.as_tensor(shift, dtype=out.dtype, device=out.device)
        return torch.minimum(torch.maximum(out, low), high)

    def bounds(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` with dimensions 0-2 bounded by ``±bound`` (the offset has no box of its own:
        without a bound they stay as given, unbounded)."""
        if self.bound <= 0:
            return lo, hi
        lo, hi = lo.clone(), hi.clone()
        moved = self.scale > 0
        lo[:, :self.DIMS] = torch.where(moved, -self.bound, lo[:, :self.DIMS])
        hi[:, :self.DIMS] = torch.where(moved, self.bound, hi[:, :self.DIMS])
        return lo, hi
