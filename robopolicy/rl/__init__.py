"""Reinforcement-learning pieces shared by every refinement method (one of each).

- :mod:`~robopolicy.rl.ppo`: GAE (per step, or over semi-MDP decisions), the clipped surrogate,
  and the one PPO update (epochs of minibatches, target-KL stop) that residual PPO, PPO from
  scratch and RPD run.
- :mod:`~robopolicy.rl.actor_critic`: the Gaussian actor (optional categorical switch dimensions)
  and critic over standardized inputs, and its action distribution, each part with its own
  log-probability.
- :mod:`~robopolicy.rl.normalize`: running input statistics and the running return scale.
"""

from robopolicy.rl.actor_critic import ActionDist, ActorCritic, mlp
from robopolicy.rl.normalize import RewardScaler, RunningNorm
from robopolicy.rl.ppo import PPOSettings, gae, ppo_loss, ppo_update

__all__ = ["ActionDist", "ActorCritic", "PPOSettings", "RewardScaler", "RunningNorm", "gae", "mlp", "ppo_loss",
           "ppo_update"]
