"""How a state-based ArmPickPlace policy's episodes end, and what scripted help would change.

    robopolicy diagnose pickplace-failures --checkpoint outputs/train/arm_state_75/final
    robopolicy diagnose pickplace-failures --checkpoint CKPT release=step
    robopolicy diagnose pickplace-failures --checkpoint CKPT steps_per_chunk=16 correct=center,carry
    robopolicy diagnose pickplace-failures --checkpoint CKPT grasp_offsets=true

Runs the policy (a plain chunk checkpoint, ``steps_per_chunk`` actions per chunk, or a refined
one, deterministic) on the evaluation seeds and sorts every episode by how it ended:

- ``success``;
- ``never lifted``: the named cube never rose off the table;
- ``held over the bowl``: at the time limit the cube is still in the gripper, above the bowl;
- ``held elsewhere``: still in the gripper, not above the bowl;
- ``dropped or placed outside``: on the table (or the bowl's rim) outside the success radius;
  among them, those lifted for fewer than 5 steps (knocked or tipped at the grasp).

``release=step`` is the anchor for a gripper correction: it forces the gripper open on every step
where the lifted cube is within 2 cm (xy) of the bowl's centre. ``correct`` adds scripted
state-feedback corrections of the kinds a residual can make, from the privileged scene state
(comma-separated; see :class:`Corrections`). ``grasp_offsets=true`` replays every never-lifted
episode once per constant xy offset of the commanded tool-centre point (a 5 x 5 grid, up to
``offset`` metres a side), held until the cube is lifted: could a Cartesian correction save it.

Scene state layout (``observation.environment_state``, see ``sim_envs.arm.env``): ``[3:6]`` the
named cube's xyz, ``[8:11]`` the named bowl's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from robopolicy.envs import EnvConfig
from sim_envs.arm import so101

LIFTED = so101.CUBE_HALF + 0.0075
"""Cube centre height (m) that counts as lifted (it rests at ``CUBE_HALF``)."""
NEAR = 0.02
"""xy distance (m) of the lifted cube from the bowl's centre where ``release=step`` opens."""
ENV_ID = "robopolicy/ArmPickPlace-v0"
KINDS = ("success", "never lifted", "held over the bowl", "held elsewhere", "dropped or placed outside")
CORRECTIONS = ("center", "narrow", "roll", "carry")


@dataclass
class PickPlaceFailuresConfig:
    checkpoint: str = ""
    """A state-based ArmPickPlace policy: a plain chunk checkpoint, or a refined one over it."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """ArmPickPlace-v0's kwargs (e.g. ``max_steps``); cameras and scene state are set to fit the
    checkpoint, as in ``robopolicy eval``."""
    episodes: int = 100
    seed: int = 100_000
    """Episode i runs seed + i (the evaluation seeds by default)."""
    steps_per_chunk: int | None = None
    """Actions executed per predicted chunk; ``None``: the whole chunk (as ``robopolicy eval``)."""
    release: str = "none"
    """``none`` or ``step``: force the gripper open where the lifted cube is over the bowl."""
    correct: str = ""
    """Scripted corrections, comma-separated: ``center``, ``narrow``, ``roll``, ``carry``."""
    correct_range: float = 0.02
    """Largest xy shift (m) of the ``center`` and ``carry`` corrections."""
    correct_every: int = 1
    """Recompute the ``center`` / ``carry`` shift every this many steps and hold it in between."""
    grasp_offsets: bool = False
    """Also replay each never-lifted episode once per xy offset of the commanded tool point."""
    offset: float = 0.01
    """Largest grasp offset (m) of that grid."""
    threads: int = 1
    """torch CPU threads for the policy."""

    def __post_init__(self) -> None:
        from robopolicy.config import ConfigError

        if self.episodes < 1:
            raise ConfigError(f"episodes must be >= 1, got {self.episodes}")
        if self.release not in ("none", "step"):
            raise ConfigError(f"release must be none or step, got {self.release!r}")
        if self.correct_every < 1:
            raise ConfigError(f"correct_every must be >= 1, got {self.correct_every}")
        unknown = set(self.corrections) - set(CORRECTIONS)
        if unknown:
            raise ConfigError(f"correct: unknown {sorted(unknown)} (choose from {', '.join(CORRECTIONS)})")

    @property
    def corrections(self) -> list[str]:
        return [c for c in self.correct.split(",") if c]


def classify(success: bool, max_z: float, z: float, dist: float) -> str:
    """An episode's end from its success, the cube's highest and last height and its last xy
    distance from the bowl's centre (m)."""
    if success:
        return "success"
    if max_z < LIFTED:
        return "never lifted"
    if z > LIFTED:
        return "held over the bowl" if dist < so101.BOWL_RADIUS else "held elsewhere"
    return "dropped or placed outside"


def clip_norm(v: np.ndarray, limit: float) -> np.ndarray:
    """``v`` scaled down to norm ``limit`` if it is longer."""
    n = float(np.linalg.norm(v))
    return v if n <= limit else v * (limit / n)


class Corrections:
    """Scripted corrections of a joint-space command, from the privileged scene state.

    - ``center``: while the cube is not lifted and the commanded tool-centre point is within 4 cm
      (xy) and 5 cm (height) of it, move the command's xy onto the cube's (at most ``limit`` m);
    - ``narrow``: in the same phase, open the gripper no wider than the oracle does (the cube's
      width across the jaws + 8 mm a side), so the open fingers stay clear of the neighbours;
    - ``roll``: in the same phase (6 cm), turn the wrist roll to the oracle's grasp yaw;
    - ``carry``: while the cube is lifted, move the command's xy toward the bowl's centre.
    """

    def __init__(self, kinds: list[str], limit: float = 0.02, every: int = 1):
        from sim_envs.arm.ik import ArmIK

        self.kinds, self.limit, self.every = set(kinds), limit, every
        self.arm = ArmIK()
        self.held = np.zeros(3)  # the center / carry shift (m), recomputed every ``every`` steps

    def __call__(self, action: np.ndarray, state: np.ndarray, scene: np.ndarray, info: dict, t: int) -> np.ndarray:
        """``action`` (joint targets, gripper last) with the corrections applied, unclipped."""
        from sim_envs.arm.oracle import ArmOracle, cube_yaw

        arm, action = self.arm, action.astype(np.float64)
        cmd = arm.fk(action[:5])[0]
        cube, bowl = scene[3:6], scene[8:11]
        near = float(np.linalg.norm(cmd[:2] - cube[:2]))
        approach = scene[5] < LIFTED and cmd[2] < cube[2] + 0.05
        if t % self.every == 0:
            self.held[:] = 0.0
            if "center" in self.kinds and approach and near < 0.04:
                self.held[:2] = clip_norm(cube[:2] - cmd[:2], self.limit)
            if "carry" in self.kinds and scene[5] >= LIFTED:
                self.held[:2] = clip_norm(bowl[:2] - cube[:2], self.limit)
        if self.held.any():
            action[:4] += arm.joint_shift(action[:5], self.held)
        k = int(info["goal_cube"])
        if "roll" in self.kinds and approach and near < 0.06:
            action[4] = arm.roll_for_yaw(action[:5], ArmOracle._grasp_yaw(info, k), symmetry=np.pi / 2)
        if "narrow" in self.kinds and approach and near < 0.04 and action[5] > state[5] - 0.05:
            rel = cube_yaw(info["cube_quat"][k]) - arm.gripper_yaw(state[:5].astype(np.float64))
            extent = so101.CUBE_HALF * (abs(np.cos(rel)) + abs(np.sin(rel)))
            action[5] = min(action[5], (extent + 0.008 - so101.PAD_INNER_GAP) / so101.GRIP_M_PER_RAD)
        return action


def run_episode(env: Any, actor: Any, seed: int, edit: Callable[..., np.ndarray] | None = None) -> dict:
    """One episode; ``edit(action, obs, info, t, max_z)`` may change each action before it runs.
    Returns how it ended (``kind``) and for how many steps the cube was lifted."""
    obs, info = env.reset(seed=seed)
    actor.reset()
    low, high = env.action_space.low, env.action_space.high
    max_z, lifted_steps, t, term, trunc = 0.0, 0, 0, False, False
    while not (term or trunc):
        action = actor.act(obs)
        if edit is not None:
            action = np.clip(edit(action, obs, info, t, max_z), low, high)
        obs, _r, term, trunc, info = env.step(action.astype(np.float32))
        scene = np.asarray(obs["observation.environment_state"])
        max_z = max(max_z, float(scene[5]))
        lifted_steps += int(scene[5] > LIFTED)
        t += 1
    kind = classify(bool(info.get("is_success")), max_z, float(scene[5]), float(np.linalg.norm(scene[3:5] - scene[8:10])))
    return {"kind": kind, "lifted_steps": lifted_steps}


def make_edit(cfg: PickPlaceFailuresConfig, gripper_open: float) -> Callable[..., np.ndarray] | None:
    """The per-step action edit of ``release`` and ``correct`` (``None``: the policy's own actions)."""
    fix = Corrections(cfg.corrections, cfg.correct_range, cfg.correct_every) if cfg.corrections else None
    if fix is None and cfg.release == "none":
        return None

    def edit(action: np.ndarray, obs: dict, info: dict, t: int, _max_z: float) -> np.ndarray:
        scene = np.asarray(obs["observation.environment_state"])
        if cfg.release == "step" and scene[5] > LIFTED and float(np.linalg.norm(scene[3:5] - scene[8:10])) < NEAR:
            action[5] = gripper_open
        if fix is not None:
            action = fix(action, np.asarray(obs["observation.state"]), scene, info, t)
        return action

    return edit


def grasp_offset_successes(env: Any, actor: Any, seed: int, offset: float) -> int:
    """How many of 25 constant xy offsets of the commanded tool point (held until the cube is
    lifted) turn the episode of ``seed`` into a success."""
    from sim_envs.arm.ik import ArmIK

    arm, wins = ArmIK(), 0
    for dx in np.linspace(-offset, offset, 5):
        for dy in np.linspace(-offset, offset, 5):
            shift = np.array([dx, dy, 0.0])

            def edit(action, _obs, _info, _t, max_z, shift=shift):
                if max_z < LIFTED:
                    action[:4] += arm.joint_shift(action[:5], shift)
                return action

            wins += run_episode(env, actor, seed, edit)["kind"] == "success"
    return wins


def diagnose(cfg: PickPlaceFailuresConfig, progress: bool = True) -> dict:
    """Run the episodes of ``cfg`` and count how they end (see the module docstring)."""
    import torch
    from tqdm import tqdm

    from robopolicy.diagnose.stepping import PolicyActor, make_diagnosis_env
    from robopolicy.models.loading import load_policy

    if not cfg.checkpoint:
        from robopolicy.config import ConfigError

        raise ConfigError("checkpoint: give the policy checkpoint to diagnose (--checkpoint DIR)")
    torch.set_num_threads(cfg.threads)
    policy = load_policy(cfg.checkpoint)
    env = make_diagnosis_env(policy, EnvConfig(ENV_ID, dict(cfg.env_kwargs)))
    if "observation.environment_state" not in env.observation_space.spaces:
        raise ValueError(f"{cfg.checkpoint}: the env gives no observation.environment_state; the diagnosis reads "
                         f"the scene from it (a state-based policy, or env.kwargs.env_state=true)")
    actor = PolicyActor(policy, cfg.steps_per_chunk)
    edit = make_edit(cfg, float(env.action_space.high[5]))
    counts, knocked, offsets = dict.fromkeys(KINDS, 0), 0, []
    try:
        for e in tqdm(range(cfg.episodes), desc="episodes", unit="ep", disable=not progress, leave=False):
            res = run_episode(env, actor, cfg.seed + e, edit)
            counts[res["kind"]] += 1
            knocked += res["kind"] == "dropped or placed outside" and res["lifted_steps"] < 5
            if cfg.grasp_offsets and res["kind"] == "never lifted":
                offsets.append(grasp_offset_successes(env, actor, cfg.seed + e, cfg.offset))
    finally:
        env.close()
    return {"checkpoint": cfg.checkpoint, "episodes": cfg.episodes, "seed": cfg.seed, "release": cfg.release,
            "correct": cfg.correct, "counts": counts, "knocked": knocked,
            "grasp_offsets": offsets if cfg.grasp_offsets else None, "offset": cfg.offset}


def report(result: dict) -> list[str]:
    """The breakdown as a markdown table, the optional findings, and a one-line summary last."""
    n, counts = result["episodes"], result["counts"]
    extra = f", corrections: {result['correct']}" if result["correct"] else ""
    lines = [f"| {result['checkpoint']} (release: {result['release']}{extra}) | episodes | share |", "|---|---:|---:|"]
    lines += [f"| {kind} | {counts[kind]} | {counts[kind] / n:.0%} |" for kind in KINDS]
    if counts["dropped or placed outside"]:
        lines.append(f"of the {counts['dropped or placed outside']} dropped: {result['knocked']} lifted for fewer "
                     "than 5 steps (knocked or tipped at the grasp)")
    offsets = result["grasp_offsets"]
    if offsets:
        lines.append(f"grasp offsets (xy grid of 25 within ±{result['offset'] * 100:.1f} cm, until the lift): "
                     f"{sum(k > 0 for k in offsets)} of {len(offsets)} never-lifted episodes succeed with at least "
                     f"one; {np.mean(offsets) / 25:.0%} of the offsets succeed on average")
    failures = ", ".join(f"{kind} {counts[kind]}" for kind in KINDS[1:])
    lines.append(f"[diagnose] pickplace-failures {result['checkpoint']}: success {counts['success'] / n:.0%} "
                 f"of {n} ({failures})")
    return lines
