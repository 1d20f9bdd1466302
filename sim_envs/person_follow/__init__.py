"""``robopolicy/PersonFollow-v0``: follow one person among others with a differential-drive robot.

Public API: :class:`PersonFollowEnv` (the env), :class:`WaypointFollowWrapper` and
:func:`pure_pursuit` (waypoints -> twist), :func:`summarize_episodes` and the rest of
:mod:`sim_envs.person_follow.metrics` (metric definitions).
"""

from sim_envs.person_follow.env import SPLITS, PersonFollowEnv
from sim_envs.person_follow.metrics import summarize_episodes
from sim_envs.person_follow.oracle import PersonFollowOracle
from sim_envs.person_follow.waypoints import WaypointFollowWrapper, arc_waypoints, pure_pursuit

__all__ = [
    "SPLITS",
    "PersonFollowEnv",
    "PersonFollowOracle",
    "WaypointFollowWrapper",
    "arc_waypoints",
    "pure_pursuit",
    "summarize_episodes",
]
