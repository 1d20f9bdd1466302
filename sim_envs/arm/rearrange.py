"""Reset behaviours: the arm itself puts the scene into a new layout, without ``env.reset``.

A real robot that collects for hours has nobody to tidy its table between episodes: after each
forward episode a *reset behaviour* moves the objects to a new random layout (RoboClaw's
forward/reset pairing). In simulation the same loop runs on one continuous world.

- :func:`sample_layout` draws the next layout from the scene as it stands: a new table position
  for every cube, kept clear for the cubes' :func:`move_order`, and the next goal (cube, bowl).
  Bowls (zones) are fixed to the table and the objects keep their colours, as physical objects do.
- A reset behaviour drives the arm toward that layout: anything with ``rearrange(env, layout)
  -> steps`` (:class:`ResetBehaviour`). :class:`ScriptedRearrange` is the scripted one; a learned
  reset (a policy conditioned on the target layout) plugs in through the same method.
- :func:`check_layout` judges the scene against the layout on its own, whatever the behaviour
  believes: every cube flat on the table within ``tolerance`` of its place, the arm clear.
- :func:`begin_episode` starts the next episode there (the env's ``continue_episode``).

Works on the arm tasks with cubes (``ArmPickPlaceEnv``, ``ArmPushCubeEnv``); joint or
``ee_delta`` actions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from sim_envs.arm import so101

PLACE_TOLERANCE = 0.015  # m: a cube this close (xy) to its sampled place is in place
CLEAR_Z = 0.04  # m: the tool-centre point above this height leaves the scene untouched
REACH = 0.24  # m from the arm's base (xy): the farthest a cube can be picked from (hovering above it)
FLAT_TOLERANCE = 0.003  # m: a cube whose centre lies this close to its resting height is flat on the table
_SETTLE_STEPS = 8  # control steps the retreat runs before a placement is judged


@dataclass(frozen=True)
class Layout:
    """A scene to reset to: ``cube_xy`` (C, 2) table positions (m, world frame) and the next goal."""

    cube_xy: np.ndarray
    goal_cube: int
    goal_target: int


@dataclass(frozen=True)
class LayoutCheck:
    """Whether the scene matches a layout: per-cube xy errors (m) and, when not, why;
    ``recoverable`` is False when no rearranging can fix it (a cube out of the arm's reach or off
    the table): only a person (in simulation, ``env.reset``) can."""

    ok: bool
    errors: tuple[float, ...]
    reason: str = ""
    kind: str = ""  # of a failure: out_of_reach, not_flat, off_place, arm_in_scene
    recoverable: bool = True


class ResetBehaviour(Protocol):
    """Drives the arm (``env.step``) until the scene should match ``layout``; returns the control
    steps taken. It need not succeed: :func:`check_layout` decides."""

    def rearrange(self, env: Any, layout: Layout) -> int: ...


def _base(env: Any) -> Any:
    base = getattr(env, "unwrapped", env)
    if not getattr(base, "num_cubes", 0):
        raise TypeError(f"{type(base).__name__}: a reset behaviour rearranges cubes; this task has none")
    return base


def _allowed_goals(base: Any) -> list[tuple[int, int]]:
    """(cube, target) goal pairs the task's split may ask for, with the colours on the table."""
    held_out = getattr(base, "HELDOUT_PAIRS", frozenset())
    split = getattr(base, "split", "all")
    pairs = []
    for c in range(base.num_cubes):
        for t in range(base.num_targets):
            pair_held_out = (base.cube_colors[c], base.target_colors[t]) in held_out
            if split == "all" or (split == "test") == pair_held_out:
                pairs.append((c, t))
    return pairs


class NoLayout(RuntimeError):
    """The table as it stands has no room for a new layout (or the split no goal pair)."""


def move_order(env: Any) -> tuple[int, ...]:
    """The order the cubes are moved in: a cube held in the gripper first, then by index."""
    base = _base(env)
    held = [i for i in range(base.num_cubes) if _held(base, i)]
    return tuple(held + [i for i in range(base.num_cubes) if i not in held])


def _held(base: Any, i: int) -> bool:
    cube, tcp = base.data.xpos[base._cube_body[i]], base.data.site_xpos[base._tcp]
    return bool(np.linalg.norm(cube - tcp) < 0.025 and cube[2] > so101.CUBE_HALF + 0.01)


def sample_layout(env: Any, rng: np.random.Generator) -> Layout:
    """A new table position for every cube and the next goal pair (among those the task's split
    allows), in the task's own sampling sector. Cubes move in :func:`move_order`; each new
    position keeps clear of the bowls (zones), of the cubes not yet moved where they are now, and
    of the new positions drawn before it. Raises :class:`NoLayout` when the table has no room or
    the split no pair with these colours."""
    base = _base(env)
    goals = _allowed_goals(base)
    if not goals:
        raise NoLayout(f"split {getattr(base, 'split', 'all')!r} asks for no goal pair with cubes "
                       f"{base.cube_colors} and bowls {base.target_colors}")
    targets = base.data.mocap_pos[base._target_mocap][:, :2]
    now = base.data.xpos[base._cube_body][:, :2]
    order = move_order(env)
    target_sep = so101.BOWL_RADIUS + 0.045  # the open fingers stay clear of a bowl's wall
    for _ in range(200):
        placed: dict[int, np.ndarray] = {}
        for k, i in enumerate(order):
            existing = [(t, target_sep) for t in targets] + [(now[j], 0.05) for j in order[k + 1:]]
            pts = base._sample_points(rng, 1, (0.13, 0.22), (-1.1, 1.1), [0.05],
                                      existing + [(p, 0.05) for p in placed.values()])
            if pts is None:
                break
            placed[i] = pts[0]
        else:
            c, t = goals[int(rng.integers(len(goals)))]
            return Layout(np.array([placed[i] for i in range(base.num_cubes)]), c, t)
    raise NoLayout("no room on the table for a new layout: the cubes not yet moved crowd it")


def check_layout(env: Any, layout: Layout, tolerance: float = PLACE_TOLERANCE) -> LayoutCheck:
    """The scene against ``layout``: each cube at rest on the table (not tipped, not stacked)
    within ``tolerance`` (xy) of its place, and the tool-centre point above ``CLEAR_Z``."""
    base = _base(env)
    pos = base.data.xpos[base._cube_body]
    errors = tuple(float(np.linalg.norm(pos[i, :2] - layout.cube_xy[i])) for i in range(base.num_cubes))
    for i, err in enumerate(errors):
        if not reachable(pos[i]):
            return LayoutCheck(False, errors, f"cube {i} ({base.cube_colors[i]}) is out of the arm's reach "
                                              f"({np.linalg.norm(pos[i, :2]) * 100:.0f} cm from its base, "
                                              f"z {pos[i, 2] * 100:.1f} cm)", "out_of_reach", recoverable=False)
        if not _flat(pos[i]):
            return LayoutCheck(False, errors, f"cube {i} ({base.cube_colors[i]}) is not flat on the table "
                                              f"(z {pos[i, 2] * 100:.1f} cm)", "not_flat")
        if err > tolerance:
            return LayoutCheck(False, errors, f"cube {i} ({base.cube_colors[i]}) is {err * 100:.1f} cm from its place",
                               "off_place")
    if base.data.site_xpos[base._tcp][2] < CLEAR_Z:
        return LayoutCheck(False, errors, "the arm did not clear the scene", "arm_in_scene")
    return LayoutCheck(True, errors)


def _flat(cube: np.ndarray) -> bool:
    """Whether a cube at ``cube`` (xyz, m) rests flat on the table: not tipped, held or stacked."""
    return abs(float(cube[2]) - so101.CUBE_HALF) <= FLAT_TOLERANCE


def reachable(cube: np.ndarray) -> bool:
    """Whether the arm can pick a cube at ``cube`` (xyz, m): within :data:`REACH` of the base and
    on the table, not fallen off it."""
    return bool(math.hypot(cube[0], cube[1]) <= REACH and cube[2] > 0.0)


def begin_episode(env: Any, layout: Layout) -> tuple[dict, dict]:
    """Start the next episode on the scene as it stands, with ``layout``'s goal."""
    return _base(env).continue_episode(layout.goal_cube, layout.goal_target)


class ScriptedRearrange:
    """The scripted reset: pick each cube from wherever it is and place it at its new position.

    Each move is the pick-and-place oracle's own plan with the cube's new position as its "bowl"
    (``replan`` on: it starts from wherever the forward episode left the arm, and carries on with
    a cube already in the gripper). The cubes move in :func:`move_order` (a held one first). A placement that misses
    by more than the check's tolerance is picked up again; each cube gets ``steps_per_cube``
    control steps. The behaviour renders nothing (the cameras are off while it runs).
    """

    def __init__(self, noise: float = 0.0, seed: int | None = None, steps_per_cube: int = 300,
                 tolerance: float = PLACE_TOLERANCE) -> None:
        self.noise, self.steps_per_cube, self.tolerance = float(noise), int(steps_per_cube), float(tolerance)
        self.rng = np.random.default_rng(seed)

    def rearrange(self, env: Any, layout: Layout) -> int:
        """Move every cube to ``layout``; returns the control steps taken."""
        base = _base(env)
        order = move_order(env)  # the order sample_layout kept the new places clear for
        cameras, base.use_cameras = base.use_cameras, False
        try:
            return sum(self._move(base, i, layout.cube_xy[i]) for i in order)
        finally:
            base.use_cameras = cameras

    def _move_info(self, base: Any, i: int, place: np.ndarray) -> dict:
        """The env's info with the cube's new position as the goal "bowl" of the oracle's plan."""
        info = base._info(False)
        info["target_pos"] = np.vstack([info["target_pos"], [place[0], place[1], 0.0]])
        info["goal_cube"], info["goal_target"] = i, base.num_targets
        return info

    def _move(self, base: Any, i: int, place: np.ndarray) -> int:
        """Pick cube ``i`` and put it at ``place`` (xy); returns the steps taken (none for a cube
        out of reach)."""
        from sim_envs.arm.oracle import ArmOracle

        if not reachable(base.data.xpos[base._cube_body[i]]):
            return 0

        oracle = ArmOracle(base.action_space, task="pickplace", action_mode=base.action_mode, ee_step=base.ee_step,
                           noise=self.noise, seed=int(self.rng.integers(2**31)))
        oracle.replan = True
        obs, info = base._obs(), self._move_info(base, i, place)
        oracle.reset(obs, info)
        for step in range(1, self.steps_per_cube + 1):
            obs, _, _, _, _ = base.step(oracle.act(obs, info).action)
            info = self._move_info(base, i, place)
            if oracle.phase == "retreat" and oracle.phase_steps >= _SETTLE_STEPS:
                cube = base.data.xpos[base._cube_body[i]]
                resting = _flat(cube)
                if resting and math.dist(cube[:2], place) <= self.tolerance:
                    if info["ee_pos"][2] > CLEAR_Z:
                        return step
                elif resting:  # it landed off its place: pick it up again
                    oracle._goto("approach")
        return self.steps_per_cube
