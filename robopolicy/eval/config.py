"""Evaluation configs: which env and splits, how chunks are executed, how an env maps onto a policy.

Loadable with :func:`robopolicy.config.load_config` (``robopolicy eval --config FILE key=value``)::

    env: {id: robopolicy/ArmPickPlace-v0, kwargs: {image_size: 96}}
    episodes: 50
    workers: 2
    chunk: {mode: ensemble, ensemble_coeff: 0.01}

This module imports no torch: env worker processes unpickle it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from robopolicy.config import ConfigError
from robopolicy.envs import EnvConfig
from robopolicy.scale.ray_backend import RayConfig

PERSON_FOLLOW = "robopolicy/PersonFollow-v0"
PERSON_FOLLOW_SPLITS = ("stt", "dt", "at")
InstructionMode = Literal["normal", "swap", "blank"]
INSTRUCTION_MODES = get_args(InstructionMode)


@dataclass
class ChunkConfig:
    """How a predicted chunk becomes one action per env step.

    ``chunk`` mode runs ``steps_per_chunk`` actions of each chunk, then asks for a new one.
    ``ensemble`` mode (ACT's temporal ensembling) asks for a chunk every ``steps_per_chunk``
    steps (default 1) and executes, for step t, the weighted mean of every stored chunk's
    prediction for t, with weight ``exp(-ensemble_coeff * i)`` for the i-th oldest chunk (i = 0:
    the oldest; ACT uses 0.01). ``crossfade`` mode asks every ``steps_per_chunk`` steps (default
    half a chunk) and the new chunk takes over from the previous one over ``crossfade_steps``.
    Waypoint policies run in ``chunk`` mode only: between predictions the waypoints are shifted
    into the frame of the waypoint just executed. The executor is
    :class:`hardware.control.chunking.ChunkExecutor`, shared with refinement and the control node.
    """

    mode: Literal["chunk", "ensemble", "crossfade"] = "chunk"
    steps_per_chunk: int | None = None
    """Actions executed per chunk; ``None``: the mode's default (the whole chunk for ``chunk``, 1
    for ``ensemble`` and for waypoints, half the chunk for ``crossfade``)."""
    ensemble_coeff: float = 0.01
    """Decay of the ensembling weights over chunk age (0: plain mean; > 0 favours older chunks)."""
    crossfade_steps: int = 4
    """``crossfade``: steps over which a new chunk takes over from the previous one (0: at once)."""
    predict_every_step: bool | None = None
    """Call the policy on every step even in ``chunk`` mode (keeps its temporal context fed);
    ``None``: when the policy has a temporal context (``context_strides`` beyond 0)."""

    def __post_init__(self) -> None:
        if self.steps_per_chunk is not None and self.steps_per_chunk < 1:
            raise ValueError(f"chunk.steps_per_chunk must be >= 1 or null, got {self.steps_per_chunk}")
        if self.ensemble_coeff < 0:
            raise ValueError(f"chunk.ensemble_coeff must be >= 0, got {self.ensemble_coeff}")
        if self.crossfade_steps < 0:
            raise ValueError(f"chunk.crossfade_steps must be >= 0, got {self.crossfade_steps}")


@dataclass
class EnvMapping:
    """How any gymnasium env's observation and action map onto the policy's LeRobot keys.

    The robopolicy tasks already speak LeRobot keys, so the defaults change nothing. For another
    env, e.g. one with ``{"pixels": (H, W, 3), "agent_pos": (2,)}`` observations::

        mapping:
          observation: {observation.images.front: pixels, observation.state: agent_pos}
          task: "push the T onto its target"
          action_scale: [256.0, 256.0]

    An env key ``"."`` takes the whole observation (a Box env without a dict).
    """

    observation: dict[str, str] = field(default_factory=dict)
    """Policy key -> env observation key; empty: the env's own keys are used as they are."""
    task: str | None = None
    """Instruction given to the policy when the env has no ``task`` (or to override it)."""
    action_scale: list[float] | None = None
    """Env action = policy action * action_scale + action_offset (per dimension or one value)."""
    action_offset: list[float] | None = None
    follower: Literal["auto", "none", "waypoints"] = "auto"
    """``waypoints``: a (v, omega) env is driven through ``WaypointFollowWrapper``; ``auto``:
    when the policy predicts waypoints."""

    def __post_init__(self) -> None:
        for key in self.observation:
            if key != "task" and not key.startswith("observation."):
                raise ValueError(f"mapping.observation key {key!r} must be a LeRobot key "
                                 f"(observation.state, observation.images.<camera>) or 'task'")


@dataclass
class EvalConfig:
    """``robopolicy eval``: roll a checkpoint out in an env and report per-split metrics."""

    checkpoint: str = ""
    env: EnvConfig = field(default_factory=EnvConfig)
    splits: list[str] | None = None
    """PersonFollow splits to evaluate; ``None``: ``env.kwargs.split`` if set, else all three."""
    episodes: int = 20
    """Episodes per split. Episode i of every split uses seed ``seed + i`` (same seeds for every policy)."""
    workers: int = 1
    """Parallel envs; > 1 runs them in worker processes (gymnasium AsyncVectorEnv), or Ray actors."""
    backend: Literal["local", "ray"] = "local"
    """Where the episodes run: ``local`` worker processes (the policy here), or ``ray`` actors, each
    with a copy of the policy running whole episodes (``robopolicy[scale]``); the same seeds give
    the same episodes."""
    ray: RayConfig = field(default_factory=RayConfig)
    """With ``backend: ray``: ``ray.address`` (None: a Ray started on this machine)."""
    seed: int = 100_000
    """First episode seed (far from the collection seeds 0.. so evaluation scenes are unseen)."""
    image_size: int | None = None
    """Camera size passed to the env; ``None``: the checkpoint's training image size if it records
    one, else the env default."""
    max_steps: int | None = None
    """Cut episodes at this many steps (for envs without their own limit); ``None``: the env's."""
    instruction: InstructionMode = "normal"
    """What the policy is told: ``normal``, the task's instruction; ``swap``, the same scene with
    the instruction naming another visible person, who becomes the target (envs that take an
    ``instruction`` argument: PersonFollow); ``blank``, an empty instruction (any env)."""
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    mapping: EnvMapping = field(default_factory=EnvMapping)
    videos: int = 2
    """MP4s of the first this-many episodes of each split (``env.render()``: egocentric +
    top-down for tracking, front + wrist + top-down for the arm)."""
    success: Literal["auto", "final", "any"] = "auto"
    """How an episode's success is read from the env's ``info``: ``final``, the last step's
    ``is_success`` (or ``success``); ``any``, any step's; ``auto``, ``final`` for an env that
    reports ``is_success`` and ``any`` for one that reports only ``success`` (Meta-World's
    convention: an episode need not end on success). An env that reports neither gets a warning."""
    render_size: int | None = 160
    """Height of the video views (passed to the env as ``render_size``); ``None``: env default."""
    device: str = "auto"
    """Torch device for the policy: ``auto`` (cuda if available), ``cpu``, ``cuda``..."""
    threads: int = 0
    """torch CPU threads for the policy (0: torch's default). With env workers sharing a small
    CPU, 1 avoids oversubscription."""
    out: str = "outputs/eval"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.episodes < 1:
            raise ValueError(f"episodes must be >= 1, got {self.episodes}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.videos < 0:
            raise ValueError(f"videos must be >= 0, got {self.videos}")
        if self.instruction not in INSTRUCTION_MODES:
            raise ValueError(f"instruction must be one of {list(INSTRUCTION_MODES)}, got {self.instruction!r}")
        if self.success not in ("auto", "final", "any"):
            raise ValueError(f"success must be auto, final or any, got {self.success!r}")

    def mapping_for_policy(self) -> EnvMapping:
        """The env mapping with the instruction mode applied (``blank``: the task is ``""``)."""
        if self.instruction == "blank":
            return replace(self.mapping, task="")
        return self.mapping

    def split_list(self) -> list[str | None]:
        """The splits this run covers (``[None]`` for envs without splits)."""
        if self.splits:
            if self.env.id == PERSON_FOLLOW:
                bad = [s for s in self.splits if s not in PERSON_FOLLOW_SPLITS]
                if bad:
                    raise ConfigError(f"unknown split {bad[0]!r} for {self.env.id} (splits: {list(PERSON_FOLLOW_SPLITS)})")
            return list(self.splits)
        if "split" in self.env.kwargs:
            return [self.env.kwargs["split"]]
        if self.env.id == PERSON_FOLLOW:
            return list(PERSON_FOLLOW_SPLITS)
        return [None]
