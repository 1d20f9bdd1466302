"""SO-101-like desktop arm tasks (reach, push, language-conditioned pick-and-place) and oracle.

Registered ids: ``robopolicy/ArmReach-v0``, ``robopolicy/ArmPushCube-v0``,
``robopolicy/ArmPickPlace-v0`` (entry points in :mod:`sim_envs.registration`).
"""

from sim_envs.arm.env import ArmEnv, ArmPickPlaceEnv, ArmPushCubeEnv, ArmReachEnv
from sim_envs.arm.ik import ArmIK
from sim_envs.arm.oracle import ArmOracle

__all__ = ["ArmEnv", "ArmIK", "ArmOracle", "ArmPickPlaceEnv", "ArmPushCubeEnv", "ArmReachEnv"]
