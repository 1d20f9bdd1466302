"""MuJoCo + gymnasium tasks for robopolicy, with scripted oracles.

Importing this package registers the tasks under the ``robopolicy/`` namespace
(``import sim_envs; gymnasium.make("robopolicy/PersonFollow-v0")``), and gymnasium's
module-prefixed ids work without an import: ``gymnasium.make("sim_envs:robopolicy/PersonFollow-v0")``.
This layer knows nothing of learning: it needs only mujoco, gymnasium and numpy.
"""

from sim_envs.core import Oracle, OracleStep, make_oracle
from sim_envs.registration import ENV_IDS, register_envs

register_envs()

__all__ = ["ENV_IDS", "Oracle", "OracleStep", "make_oracle", "register_envs"]
