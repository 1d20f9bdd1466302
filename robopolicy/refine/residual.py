"""A frozen base policy plus a small closed-loop residual actor-critic, saved as one checkpoint.

    policy = ResidualPolicy(ResidualConfig(), action_low, action_high, base=Policy.load(ckpt), input_dims=...)
    chunk = policy.predict(obs)     # (B, 1, A): this step's action in env units (base + residual)
    policy.save("outputs/refine/arm_pp")   # config.yaml + residual.safetensors + base/ (the base checkpoint)
    policy = load_policy("outputs/refine/arm_pp")   # robopolicy.models.load_policy: any checkpoint

Per step: the base's chunk is executed by the chunk executor (``execute_steps`` actions of each predicted
chunk, then the base is asked again) and the residual corrects every executed action:
``a = unnorm(clip(norm(a_base) + scale * r, -1, 1))`` with ``norm`` mapping the env's action box
to [-1, 1]; a dimension in ``switch_dims`` (a gripper) is switched instead, per decision, between
the base's command and the box's low or high end; with ``tcp`` (an arm) dimensions 0-2 move the
commanded tool-centre point in metres instead of shifting joints. The residual's input is the concatenation of
the chosen ``inputs``:

- ``state``: ``observation.state (D,)``;
- ``features``: the base's fused memory, mean-pooled ``(d_model,)``, from its latest prediction;
- ``base_action``: the current base action, normalized ``(A,)``;
- ``environment_state``: privileged scene state (simulation only; ``observation.environment_state``);
- ``base_tcp``: where the base's command puts the tool-centre point, metres ``(3,)`` (the arm's
  forward kinematics of the commanded joints; needs ``tcp``). With ``environment_state``'s cube
  and target positions, a Cartesian correction toward either is a difference of inputs, which a
  joint-space command alone hides behind the kinematics;
- ``time``: the steps this policy has acted since its ``reset``, over ``time_horizon`` ``(1,)``. A
  task that ends at a time limit has values that depend on the time left, which no observation
  shows; without it the critic averages over it (Pardo et al., time limits in RL). The policy
  counts its own steps, so ``eval`` and the control node need nothing extra from the env.

Inputs are standardized by running statistics (buffers, saved with the residual). The last actor
layer starts at zero, so an untrained residual reproduces the base exactly. A policy learnt
without a base (PPO from scratch, a compact RPD student) is
:class:`~robopolicy.refine.scratch.ScratchPolicy`, which shares this module's actor-critic surface
(:class:`ActorCriticPolicy`) and checkpoint format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from hardware.control.chunking import ChunkExecutor
from robopolicy.config import build, to_dict
from robopolicy.data.features import ENV_STATE
from robopolicy.models.loading import read_typed_config
from robopolicy.models.policy import CONFIG_FILE, STATE, Policy, PolicyError
from robopolicy.refine.adapters import TCP_ARMS, GripperSwitch, JointOffset, ToolPointOffset
from robopolicy.rl import ActionDist, ActorCritic, RunningNorm
from robopolicy.utils.files import atomic_directory

RESIDUAL_CONFIG = CONFIG_FILE  # with ``type: residual``
LEGACY_RESIDUAL_CONFIG = "residual.yaml"  # a checkpoint saved before ``config.yaml`` named its type
RESIDUAL_WEIGHTS = "residual.safetensors"
BASE_DIR = "base"
FORMAT = 2
"""Checkpoint format: 2 names the actor-critic's tensors ``ac.*`` (format 1: at the top level)."""
AC_TENSORS = ("norm.", "actor.", "critic.", "log_std")
INPUTS = ("state", "features", "base_action", "base_tcp", "environment_state", "time")


@dataclass
class ResidualConfig:
    """The residual actor-critic (saved in the checkpoint's ``config.yaml``)."""

    inputs: list[str] = field(default_factory=lambda: ["state", "features", "base_action"])
    """What the residual sees (see the module docstring); ``environment_state`` is simulation-only."""
    scale: float = 0.1
    """Residual step in normalized action units (ignored without a base: then 1)."""
    scale_per_dim: list[float] = field(default_factory=list)
    """Per action dimension, replacing ``scale`` (empty: ``scale`` everywhere). E.g. an arm's
    ``[0.1, 0.1, 0.1, 0.1, 0.1, 1.0]``: small joint corrections, but a gripper the residual can
    open or close fully (a base stuck holding the cube over the bowl never releases it otherwise)."""
    hidden: list[int] = field(default_factory=lambda: [256, 256])
    """Hidden sizes of the actor and of the (separate) critic."""
    log_std: float = -1.0
    """Initial log standard deviation of the Gaussian actor (normalized units)."""
    log_std_per_dim: list[float] = field(default_factory=list)
    """Per action dimension, replacing ``log_std`` (empty: ``log_std`` everywhere). E.g. an arm's
    ``[-2, -2, -2, -2, -2, -0.5]``: joint noise small enough for a grasp to survive it, more on
    the gripper (``experiments/probes/exploration_noise.py`` measures what a base takes)."""
    learn_std: bool = False
    """Train the log-std (ResiP keeps it fixed)."""
    execute_steps: int = 8
    """Actions executed from each base chunk before the base is asked again (ResiP: 8 of 32)."""
    decision: str = "step"
    """When the residual decides. ``step`` (ResiP): a fresh correction for every executed action.
    ``chunk``: one correction when the base plans a chunk, held over that chunk's ``execute_steps``
    actions (still closed loop at the chunk rate). PPO then sees one transition per chunk (a
    semi-MDP: the chunk's discounted reward, γ^k to the next decision), so a 200-step episode is
    ~25 decisions instead of 200, and each exploratory correction moves the arm coherently for the
    whole chunk instead of being averaged away by the joints' tracking."""
    decision_every: int = 0
    """With ``decision: chunk``: decide again every this many executed steps of a base chunk (0:
    once per chunk). E.g. 4 with whole chunks of 16: four corrections per chunk, each held over
    4 steps, so the residual can react within a long open-loop chunk (stop a push that would
    carry the cube past its zone) at a quarter of the decisions of ``step``."""
    time_horizon: int = 0
    """With the ``time`` input: the step count it is divided by (the task's episode limit, e.g.
    150 for ArmPushCube), so the input runs 0 → 1 over an episode."""
    bound: float = 0.0
    """Clamp the residual to ±this (residual units, before ``scale``) in ``predict`` and in residual
    TD3's training, which needs it > 0 (its critics only see residuals within it). 0: no clamp,
    as residual PPO trains (its samples are clipped by the action box, see ``log_prob``). With
    ``tcp``, the tool-point offset has no box of its own: ``bound`` > 0 is its box, in training as
    well (an offset beyond it executes at it, and PPO scores such a sample by the tail mass)."""
    switch_dims: list[int] = field(default_factory=list)
    """Action dimensions the residual switches instead of shifting (with a base only), e.g. ``[5]``
    for an arm's gripper. For each, the residual picks one of three settings per decision: keep the
    base's command, the action box's low end, or its high end (e.g. closed / open), a categorical
    choice in place of that dimension's Gaussian. A gripper is binary in effect: a small Gaussian
    correction never opens a closed one (a base stuck holding the cube over the bowl stays stuck),
    and one large enough to do so opens it anywhere (dropping the cube on the way). A switch
    explores by rare, whole changes and keeps the base's command otherwise."""
    switch_prob: float = 0.02
    """Initial probability of each forced setting (low, high) per decision; the rest keeps the
    base's command, which the deterministic policy (the most probable setting) starts at."""
    tcp: str = ""
    """Cartesian corrections over a joint-space arm base: the arm whose kinematics map them
    (``so101``; empty: off). Residual dimensions 0-2 then move the base's commanded tool-centre
    point by ``scale_per_dim[i] * r_i`` metres along world x, y, z, turned into a change of the
    first four joints by the Jacobian at the base's command (damped least squares); the other
    dimensions act as before (e.g. ``[0.01, 0.01, 0.005, 0, 0, 1]`` with ``switch_dims: [5]``: up
    to a centimetre or so across, half that in height, the wrist left to the base, the gripper a
    switch). A base that grasps or places a centimetre off needs one consistent xy shift, which in
    joint space is a configuration-dependent mix of four joints; joint noise of the same size also
    moves the tool up and down, which a grasp does not survive."""
    chunk: int = 1
    """Without a base only: actions per decision. The actor outputs ``chunk`` actions at once,
    executed open loop (a compact chunk policy, e.g. an RPD student of a chunk teacher whose
    own actions depend on where in its chunk it is); 1: a per-step policy."""

    def __post_init__(self):
        bad = [i for i in self.inputs if i not in INPUTS]
        if bad or not self.inputs:
            raise ValueError(f"residual.inputs: unknown {bad} (choose from {list(INPUTS)})")
        if self.execute_steps < 1:
            raise ValueError("residual.execute_steps must be >= 1")
        if self.chunk < 1:
            raise ValueError("residual.chunk must be >= 1")
        if self.decision not in ("step", "chunk"):
            raise ValueError(f"residual.decision must be 'step' or 'chunk', got {self.decision!r}")
        if self.decision_every < 0 or (self.decision_every and self.decision != "chunk"):
            raise ValueError(f"residual.decision_every must be >= 0 and needs decision: chunk, got "
                             f"{self.decision_every} with decision: {self.decision}")
        if not all(np.isfinite(v) for v in [self.log_std, *self.log_std_per_dim]):
            raise ValueError("residual.log_std and residual.log_std_per_dim must be finite")
        if any(not (np.isfinite(v) and v >= 0) for v in [self.scale, *self.scale_per_dim]):
            raise ValueError("residual.scale and residual.scale_per_dim must be finite and >= 0")
        if not (np.isfinite(self.bound) and self.bound >= 0):
            raise ValueError(f"residual.bound must be finite and >= 0, got {self.bound}")
        if len(set(self.switch_dims)) != len(self.switch_dims) or any(d < 0 for d in self.switch_dims):
            raise ValueError(f"residual.switch_dims must be distinct action indices >= 0, got {self.switch_dims}")
        if not 0.0 < self.switch_prob < 0.5:
            raise ValueError(f"residual.switch_prob must be in (0, 0.5), got {self.switch_prob}")
        if self.tcp and self.tcp not in TCP_ARMS:
            raise ValueError(f"residual.tcp: unknown arm {self.tcp!r} (choose from {sorted(TCP_ARMS)}, or empty)")
        if self.tcp and set(self.switch_dims) & {0, 1, 2}:
            raise ValueError("residual.tcp: dimensions 0-2 are the tool-centre point offset; they cannot be "
                             "switch_dims")
        if "base_tcp" in self.inputs and not self.tcp:
            raise ValueError("residual.inputs has 'base_tcp': set residual.tcp to the arm (e.g. so101) whose "
                             "kinematics compute it")
        if "time" in self.inputs and self.time_horizon < 1:
            raise ValueError("residual.inputs has 'time': set residual.time_horizon to the task's episode "
                             "limit in steps (e.g. 150 for ArmPushCube-v0)")


def _check_base(config: ResidualConfig, base: Policy | None, action_dim: int) -> None:
    """Refuse a base this residual cannot act over, or settings that need a base without one."""
    if base is not None:
        if base.output != "chunk":
            raise PolicyError("residual PPO over a waypoint base is not supported yet (the residual corrects "
                              "per-step actions; a waypoint base needs a residual on its follower's twist)")
        if list(base.config.action_shape) != [action_dim]:
            raise PolicyError(f"the base policy predicts {base.config.action_shape[-1]}-D actions but the env takes "
                              f"{action_dim}-D actions: wrong base checkpoint for this env")
        if config.chunk != 1:
            raise PolicyError("residual.chunk > 1 is for a policy without a base (the residual corrects "
                              "every executed base action)")
    elif config.tcp:
        raise PolicyError("residual.tcp moves the base's commanded tool-centre point; it needs a base "
                          "policy (--base)")
    elif config.switch_dims:
        raise PolicyError("residual.switch_dims switches between the base's command and the action box's "
                          "ends; it needs a base policy (--base)")
    elif config.decision != "step":
        raise PolicyError("residual.decision: chunk holds a correction over each base chunk; it needs a base "
                          "policy (--base)")
    else:
        bad = [i for i in config.inputs if i in ("features", "base_action", "base_tcp")]
        if bad:
            raise PolicyError(f"residual.inputs {bad} need a base policy (--base); without one use "
                              f"state and/or environment_state")
    if any(d >= action_dim for d in config.switch_dims):
        raise PolicyError(f"residual.switch_dims {config.switch_dims}: the action has {action_dim} dimensions")
    if config.tcp and action_dim < 5:
        raise PolicyError(f"residual.tcp needs an arm's joint-position action (5 joints, then the gripper); "
                          f"this one has {action_dim} dimensions")
    for key in ("scale_per_dim", "log_std_per_dim"):
        if getattr(config, key) and len(getattr(config, key)) != action_dim:
            raise PolicyError(f"residual.{key} has {len(getattr(config, key))} values, the action {action_dim}")


class ActorCriticPolicy(nn.Module):
    """What a residual and a policy learnt from scratch share: the action box, the actor-critic
    (:class:`~robopolicy.rl.ActorCritic`: input statistics, actor, critic, log-std), the action
    adapters (:mod:`~robopolicy.refine.adapters`) and the surface the refinement loops, ``eval`` and
    ``robopolicy run`` drive. A subclass says where the action it corrects comes from
    (:meth:`base_actions`): :class:`ResidualPolicy` a frozen base's executed chunks,
    :class:`~robopolicy.refine.scratch.ScratchPolicy` nothing (the sample is the whole action)."""

    output = "chunk"

    def _build(self, config: ResidualConfig, action_low: Sequence[float], action_high: Sequence[float],
               sizes: Mapping[str, int], scale: torch.Tensor) -> None:
        """Action box, input sizes (``sizes``: every input's size), actor-critic and adapters for a
        residual step of ``scale (A,)`` in normalized units."""
        self.config = config
        a = len(action_low)
        low = torch.as_tensor(np.asarray(action_low, np.float32))
        high = torch.as_tensor(np.asarray(action_high, np.float32))
        if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
            raise PolicyError("residual refinement needs a bounded action space")
        self.register_buffer("action_loc", (high + low) / 2)
        self.register_buffer("action_half", ((high - low) / 2).clamp(min=1e-6))
        missing = [k for k in config.inputs if sizes[k] <= 0]
        if missing:
            raise PolicyError(f"residual input {missing[0]!r} has no size (state_dim={sizes['state']}, "
                              f"env_state_dim={sizes['environment_state']})")
        self.input_dims = {k: int(sizes[k]) for k in config.inputs}
        self.switch = list(config.switch_dims)
        tcp = torch.zeros(a, dtype=torch.bool)
        tcp[:3] = bool(config.tcp)
        # a scale-0 dimension moves nothing, so it has no likelihood either
        self.ac = ActorCritic(sum(self.input_dims.values()), a * config.chunk, config.hidden,
                              torch.as_tensor(config.log_std_per_dim or [config.log_std] * a), config.learn_std,
                              self.switch, config.switch_prob, gaussian=(scale > 0).repeat(config.chunk),
                              chunk=config.chunk)
        self.offset = JointOffset(scale, ~tcp)
        self.switcher = GripperSwitch(self.switch) if self.switch else None
        self.tool = ToolPointOffset(config.tcp, scale, config.bound) if config.tcp else None
        self.fresh = torch.zeros(0, dtype=torch.bool)  # rows that decide this step (see ``decides``)
        self._held = torch.zeros(0, a)  # decision: chunk — each row's correction for its current chunk
        self.elapsed = np.zeros(0, dtype=np.int64)  # steps acted since reset, per row (the ``time`` input)

    def base_actions(self, obs: Mapping[str, Any], peek: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This step's actions to correct ``(B, A)`` (env units) and the base's features ``(B, d)``
        (``None``: none)."""
        raise NotImplementedError

    def _reset_elapsed(self, rows: Sequence[int] | None) -> None:
        """Restart the step count (the ``time`` input) of ``rows`` (all when ``None``)."""
        if rows is None or set(rows) >= set(range(len(self.elapsed))):
            self.elapsed = np.zeros(0, dtype=np.int64)
        else:
            self.elapsed[[r for r in rows if r < len(self.elapsed)]] = 0

    # the actor-critic's parts, as the training loops name them
    @property
    def actor(self) -> nn.Sequential:
        return self.ac.actor

    @property
    def critic(self) -> nn.Sequential:
        return self.ac.critic

    @property
    def norm(self) -> RunningNorm:
        return self.ac.norm

    @property
    def log_std(self) -> nn.Parameter:
        return self.ac.log_std

    @property
    def step_scale(self) -> torch.Tensor:
        """``(A,)``: each action dimension's residual step in normalized units (1 without a base)."""
        return self.offset.scale

    # ------------------------------------------------------------------ eval / run surface
    @property
    def horizon(self) -> int:
        """Actions per ``predict``: 1 (a per-step policy, or base + residual), or ``chunk``."""
        return int(self.config.chunk)

    @property
    def image_size(self) -> int | None:
        """The frame size (square) ``robopolicy eval`` renders cameras at; ``None``: the env's own."""
        return None

    @torch.no_grad()
    def predict(self, obs: Mapping[str, Any]) -> torch.Tensor:
        """Observation batch → ``(B, 1, A)``: this step's action (deterministic) in env units, or
        ``(B, chunk, A)`` for a chunk actor."""
        x, base_norm = self.residual_input(obs)
        out = self.env_action(base_norm, self.hold(self.dist(self.norm(x)).mode(self.bounded)))
        return out if out.ndim == 3 else out[:, None]

    @property
    def decides(self) -> torch.Tensor:
        """``(B,)`` bool: the rows whose residual decides on this step — every row with
        ``decision: step``, else the rows whose base chunk was planned by the latest
        :meth:`residual_input` call (and, with ``decision_every``, the rows that reached one of its
        multiples within their chunk)."""
        return self.fresh if self.config.decision == "chunk" else torch.ones_like(self.fresh)

    def bounded(self, r: torch.Tensor) -> torch.Tensor:
        """``r`` clamped to ``±config.bound`` (unchanged when the bound is 0)."""
        b = self.config.bound
        return r.clamp(-b, b) if b > 0 else r

    def hold(self, r: torch.Tensor) -> torch.Tensor:
        """The residual to execute ``(B, A)``: ``r`` itself per step; with ``decision: chunk``, ``r``
        on the rows that decide now, the correction held since their chunk began on the others."""
        if self.config.decision != "chunk":
            return r
        if self._held.shape[0] != r.shape[0]:
            self._held = torch.zeros_like(r)
        self._held[self.fresh] = r[self.fresh]
        return self._held.clone()

    # ------------------------------------------------------------------ pieces used by the PPO loops
    def residual_input(self, obs: Mapping[str, Any], peek: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw residual input ``(B, D_in)`` and the normalized base action ``(B, A)`` (``peek``: see
        :meth:`base_actions`)."""
        base_act, feats = self.base_actions(obs, peek)
        base_norm = ((base_act - self.action_loc) / self.action_half).clamp(-1, 1)
        if self.base is None:
            base_norm = torch.zeros_like(base_norm)
        b = base_act.shape[0]
        if len(self.elapsed) != b:  # a new batch size: every row starts at step 0
            self.elapsed = np.zeros(b, dtype=np.int64)
        parts = []
        for key in self.config.inputs:
            if key == "state":
                parts.append(_tensor(obs, STATE).reshape(base_act.shape[0], -1))
            elif key == "features":
                parts.append(feats)
            elif key == "base_action":
                parts.append(base_norm)
            elif key == "base_tcp":
                parts.append(self._command_tcp(base_act))
            elif key == "time":
                parts.append(torch.as_tensor(self.elapsed / self.config.time_horizon, dtype=torch.float32)[:, None])
            else:
                parts.append(_tensor(obs, ENV_STATE).reshape(base_act.shape[0], -1))
        if not peek:  # this call's actions will be executed: chunk steps for a chunk actor, else one
            self.elapsed += self.config.chunk
        x = torch.cat(parts, dim=1).float()
        if x.shape[1] != self.norm.mean.shape[0]:
            raise PolicyError(f"residual input has {x.shape[1]} values, the residual was built for "
                              f"{self.norm.mean.shape[0]} ({self.input_dims})")
        return x, base_norm

    def env_action(self, base_norm: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Normalized base action + the residual through the adapters → env units, inside the action
        box: ``(B, A)``, or ``(B, chunk, A)`` for a chunk actor's ``(B, chunk * A)`` output."""
        a = self.offset.apply(base_norm, residual)
        if self.switcher is not None:
            a = self.switcher.apply(base_norm, residual, a)
        out = a.clamp(-1, 1) * self.action_half + self.action_loc
        if self.tool is not None:
            low, high = self.action_loc - self.action_half, self.action_loc + self.action_half
            out = self.tool.apply(out, base_norm * self.action_half + self.action_loc, residual, low, high)
        return out

    def _command_tcp(self, base_act: torch.Tensor) -> torch.Tensor:
        """``(B, 3)``: the tool-centre point (m) of each row's commanded arm joints (``base_tcp``)."""
        return self.tool.command_tcp(base_act)

    def dist(self, x_normed: torch.Tensor) -> ActionDist:
        """The residual's distribution for normalized inputs: Gaussian over ``(B, A)`` (``(B, chunk *
        A)`` for a chunk actor: one std per action dimension, shared by the chunk's steps), with a
        categorical over each of ``switch_dims`` in place of its Gaussian."""
        return self.ac.dist(x_normed)

    def log_prob(self, dist: ActionDist | torch.distributions.Normal, r: torch.Tensor,
                 base_norm: torch.Tensor | None = None, clipped: bool = True) -> torch.Tensor:
        """Log-likelihood ``(B,)`` of residual samples ``r`` (``(B, A)`` or ``(B, chunk * A)``).

        The env executes ``clip(base_norm + scale * r, -1, 1)``: every sample beyond a bound
        executes the bound itself. ``clipped`` scores such a sample by the probability mass beyond
        the bound (:meth:`~robopolicy.rl.ActionDist.gaussian_log_prob`) with the bounds the
        adapters give; otherwise by its density. ``base_norm``: ``(B, A)`` normalized base actions
        (``None``: 0). A switch dimension adds its categorical log-probability of the chosen
        setting instead (a plain ``Normal`` for ``dist``: no switch dimensions)."""
        if isinstance(dist, torch.distributions.Normal):
            dist = ActionDist(dist, None, [], self.ac.gaussian)
        if not clipped:
            return dist.log_prob(r)
        k = self.config.chunk
        base = torch.zeros(r.shape[0], r.shape[1] // k) if base_norm is None else base_norm
        lo, hi = self.offset.bounds(base, k)
        if self.tool is not None:
            lo, hi = self.tool.bounds(lo, hi)
        return dist.log_prob(r, lo, hi)

    def value(self, x_normed: torch.Tensor) -> torch.Tensor:
        return self.ac.value(x_normed)

    def trainable_parameters(self) -> dict[str, list[nn.Parameter]]:
        return self.ac.trainable_parameters()

    # ------------------------------------------------------------------ checkpoint
    def save(self, directory: str | Path) -> Path:
        """``config.yaml`` + ``residual.safetensors`` (+ ``base/``, the base checkpoint, for a residual),
        atomically."""
        import yaml
        from safetensors.torch import save_file

        directory = Path(directory)
        state = {k: v.detach().cpu().contiguous().clone() for k, v in self.state_dict().items()
                 if not k.startswith("base.")}
        meta = {"format": FORMAT, "type": "residual", "kind": "residual" if self.base is not None else "actor_critic",
                "residual": to_dict(self.config), "base": BASE_DIR if self.base is not None else None,
                "action_low": (self.action_loc - self.action_half).tolist(),
                "action_high": (self.action_loc + self.action_half).tolist(),
                "input_dims": self.input_dims}
        with atomic_directory(directory) as tmp:
            save_file(state, str(tmp / RESIDUAL_WEIGHTS))
            (tmp / RESIDUAL_CONFIG).write_text(yaml.safe_dump(meta, sort_keys=False))
            if self.base is not None:
                self.base.save(tmp / BASE_DIR)
        return directory

class ResidualPolicy(ActorCriticPolicy):
    """A frozen base's executed chunk, corrected by an actor-critic's sample through the action
    adapters; the eval / run surface of a policy (see the module docstring).

    Parts, one role each: ``base`` (frozen, its chunks executed ``execute_steps`` at a time by the
    chunk executor), ``ac`` (:class:`~robopolicy.rl.ActorCritic`), ``offset`` / ``switcher`` /
    ``tool`` (:mod:`~robopolicy.refine.adapters`: how a sample changes the base's command). A policy
    learnt without a base is a :class:`~robopolicy.refine.scratch.ScratchPolicy`."""

    def __init__(self, config: ResidualConfig, action_low: Sequence[float], action_high: Sequence[float],
                 base: Policy, state_dim: int = 0, env_state_dim: int = 0):
        super().__init__()
        if base is None:
            raise PolicyError("a residual needs a base policy; a policy learnt from scratch is a ScratchPolicy "
                              "(robopolicy.refine.scratch)")
        a = len(action_low)
        _check_base(config, base, a)
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        state_dim = base.config.state_dim or state_dim
        sizes = {"state": state_dim, "features": base.config.d_model, "base_action": a, "base_tcp": 3,
                 "environment_state": env_state_dim, "time": 1}
        self._build(config, action_low, action_high, sizes,
                    torch.as_tensor(config.scale_per_dim or [config.scale] * a, dtype=torch.float32))
        # the base's chunks, ``execute_steps`` actions of each, per row (the one chunk executor)
        self.executor = ChunkExecutor("chunk", steps_per_chunk=config.execute_steps)
        self._planned = 0  # actions executed from each base chunk
        self._features: torch.Tensor | None = None
        self._memory_hook: Any = None

    @property
    def image_size(self) -> int | None:
        """The base's training frame size (square), so ``robopolicy eval`` renders the right cameras."""
        frame = list(self.base.config.frame_size)
        return int(frame[0]) if len(frame) == 2 and frame[0] == frame[1] else None

    def reset(self, rows: Sequence[int] | None = None) -> None:
        """Forget queued base actions (and the base's context) of ``rows`` (all when ``None``)."""
        batch = self.executor.n_envs
        if rows is None or set(rows) >= set(range(batch)):
            rows = None
            self.executor.resize(0)
            self._features = None
        else:
            self.executor.reset(rows)
        self._reset_elapsed(rows)
        # inside inference mode: the base's ring buffer was created by predict() in inference mode
        with torch.inference_mode():
            self.base.reset(rows) if rows is not None and batch else self.base.reset()

    def _pooled_memory(self, module, inputs, output) -> None:
        memory, pad = output
        keep = (~pad).float()[..., None] if pad is not None else torch.ones_like(memory[..., :1])
        with torch.inference_mode(False):
            self._features = ((memory * keep).sum(1) / keep.sum(1).clamp(min=1)).clone()

    def base_actions(self, obs: Mapping[str, Any], peek: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This step's base actions ``(B, A)`` (env units) from the chunk queues, refilled where empty,
        and the base features ``(B, d)`` of its latest prediction. ``peek``: leave the actions queued
        (a bootstrap value for the observation that the next step will act on)."""
        b = _batch_size(obs)
        if self.executor.n_envs != b:  # a new batch size: start every row afresh
            self.reset()
            self.executor.resize(b)
        need = np.flatnonzero(self.executor.needs()).tolist()
        if len(need):
            if self._memory_hook is None:
                self._memory_hook = self.base.backbone.register_forward_hook(self._pooled_memory)
            old = self._features
            chunk = self.base.predict(obs).numpy()  # (B, H, A); the hook refreshes self._features
            if old is not None and len(need) < b:  # rows mid-chunk keep the features of their chunk
                fresh = self._features.clone()
                keep = torch.ones(b, dtype=torch.bool)
                keep[need] = False
                fresh[keep] = old[keep]
                self._features = fresh
            self.executor.add(need, chunk[need])
            self._planned = min(self.config.execute_steps, chunk.shape[1])
        elif max(self.base.config.context_strides) > 0 and not peek:
            self.base.observe(obs)
        if not peek:  # a row whose chunk is still whole starts executing it now (it may have been planned by a
            # peek); with decision_every, also a row that has executed a multiple of it from its chunk
            every = self.config.decision_every or self._planned
            self.fresh = torch.as_tensor(self.executor.executed() % every == 0)
        acts = torch.as_tensor(self.executor.next(peek=peek), dtype=torch.float32)
        return acts, self._features

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device = "cpu") -> ActorCriticPolicy:
        """Rebuild a residual checkpoint saved by :meth:`save`: a :class:`ResidualPolicy` with its base, or a
        :class:`~robopolicy.refine.scratch.ScratchPolicy` for one saved without a base."""
        return load_actor_critic_policy(directory, device)


def load_actor_critic_policy(directory: str | Path, device: str | torch.device = "cpu") -> ActorCriticPolicy:
    """A ``type: residual`` checkpoint (any format): a :class:`ResidualPolicy` when it has a base, else a
    :class:`~robopolicy.refine.scratch.ScratchPolicy`."""
    from safetensors.torch import load_file

    from robopolicy.refine.scratch import ScratchPolicy

    directory = Path(directory)
    meta_path, meta = read_typed_config(directory, "residual", LEGACY_RESIDUAL_CONFIG)
    config = build(ResidualConfig, meta.get("residual") or {}, source=str(meta_path), prefix="residual.")
    base = None
    if meta.get("base"):
        base_dir = directory / str(meta["base"])
        if not (base_dir / "config.yaml").is_file():
            raise PolicyError(f"{directory} is a residual checkpoint but its base policy is missing "
                              f"(expected the base checkpoint in {base_dir}); the residual alone cannot act")
        base = Policy.load(base_dir)
    dims = meta.get("input_dims") or {}
    sizes = dict(state_dim=int(dims.get("state", 0)), env_state_dim=int(dims.get("environment_state", 0)))
    policy = (ResidualPolicy(config, meta["action_low"], meta["action_high"], base=base, **sizes) if base is not None
              else ScratchPolicy(config, meta["action_low"], meta["action_high"], **sizes))
    weights = directory / RESIDUAL_WEIGHTS
    if not weights.is_file():
        raise PolicyError(f"{weights}: file is missing")
    state = load_file(str(weights))
    if int(meta.get("format", 1)) > FORMAT:
        raise PolicyError(f"{directory}: checkpoint format {meta['format']} is newer than this code reads "
                          f"({FORMAT}); update robopolicy")
    if int(meta.get("format", 1)) < 2:  # format 1: the actor-critic's tensors at the top level
        state = {("ac." + k if k.startswith(AC_TENSORS) else k): v for k, v in state.items()}
    missing = [k for k in policy.state_dict() if not k.startswith("base.") and k not in state]
    if missing:
        raise PolicyError(f"{weights}: tensors missing (e.g. {missing[0]}): saved with another residual config")
    policy.load_state_dict(state, strict=False)
    return policy.to(device).eval()


def init_from(policy: ActorCriticPolicy, directory: str | Path, option: str) -> None:
    """Copy a saved residual's (or student's) actor, critic and input statistics into ``policy``,
    keeping ``policy``'s own log-std (the new run's exploration). The saved one must have the same
    architecture (inputs, hidden sizes, chunk, tool-point mode, input sizes) and, over a base, the
    same base weights: a residual learnt over one base means nothing over another. ``option`` names
    the setting in errors."""
    saved = load_actor_critic_policy(directory)
    mine, theirs = policy.config, saved.config
    diff = [f for f in ("inputs", "hidden", "chunk", "tcp") if getattr(mine, f) != getattr(theirs, f)]
    what = ", ".join(f"{f} {getattr(theirs, f)} vs {getattr(mine, f)}" for f in diff)
    if not what and (saved.base is None) != (policy.base is None):
        what = "it has a base policy" if saved.base is not None else "it has no base policy"
    if not what and saved.input_dims != policy.input_dims:
        what = f"inputs {saved.input_dims} vs {policy.input_dims}"
    if what:
        role = "residual" if policy.base is not None else "student"
        raise PolicyError(f"{option} {directory}: not a {role} of this architecture ({what})")
    if policy.base is not None:
        ours, theirs_base = policy.base.state_dict(), saved.base.state_dict()
        same = ours.keys() == theirs_base.keys() and all(
            ours[k].shape == theirs_base[k].shape and torch.equal(ours[k].cpu(), theirs_base[k].cpu()) for k in ours)
        if not same:
            raise PolicyError(f"{option} {directory}: its residual was learnt over another base policy "
                              f"than this run's (the base weights differ)")
    state = {k: v for k, v in saved.state_dict().items() if k != "ac.log_std" and not k.startswith("base.")}
    policy.load_state_dict(state, strict=False)


def _batch_size(obs: Mapping[str, Any]) -> int:
    for key, value in obs.items():
        if key != "task":
            arr = value if isinstance(value, torch.Tensor) else np.asarray(value)
            return int(arr.shape[0]) if arr.ndim > 1 or key == STATE and arr.ndim == 2 else 1
    return len(obs["task"]) if isinstance(obs.get("task"), (list, tuple)) else 1


def _tensor(obs: Mapping[str, Any], key: str) -> torch.Tensor:
    if key not in obs:
        raise PolicyError(f"observation lacks {key!r} (residual inputs need it; observation keys: {sorted(obs)})")
    v = obs[key]
    return (v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v, np.float32))).float()
