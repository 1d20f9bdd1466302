"""Registration of the robopolicy tasks with gymnasium."""

from __future__ import annotations

import gymnasium

_ENTRY_POINTS = {
    "robopolicy/PersonFollow-v0": "sim_envs.person_follow.env:PersonFollowEnv",
    "robopolicy/ArmReach-v0": "sim_envs.arm.env:ArmReachEnv",
    "robopolicy/ArmPushCube-v0": "sim_envs.arm.env:ArmPushCubeEnv",
    "robopolicy/ArmPickPlace-v0": "sim_envs.arm.env:ArmPickPlaceEnv",
    # a task with a known answer, for checking that a learning loop learns (sim_envs.point)
    "robopolicy/PointReach-v0": "sim_envs.point:PointReachEnv",
}

ENV_IDS: tuple[str, ...] = tuple(_ENTRY_POINTS)


def register_envs() -> None:
    """Register every task once; safe to call repeatedly (also the gymnasium plugin hook)."""
    for env_id, entry_point in _ENTRY_POINTS.items():
        if env_id not in gymnasium.registry:
            # Episode length is enforced by each env itself: success is judged at the end.
            gymnasium.register(id=env_id, entry_point=entry_point)
