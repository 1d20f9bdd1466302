"""Refinement in simulation, one readable module per method (CleanRL style).

- :mod:`~robopolicy.refine.residual_ppo`: PPO on a small closed-loop residual over a frozen base
  policy (ResiP); without a base the same loop is PPO from scratch.
- :mod:`~robopolicy.refine.residual_td3`: the same residual trained off-policy (TD3 from a replay
  buffer, sparse reward, semi-MDP chunk decisions): far fewer env steps where the task allows it.
- :mod:`~robopolicy.refine.dagger`: on-policy relabelling with filtered oracle labels.
- :mod:`~robopolicy.refine.rpd`: PPO on a compact student plus an annealed BC term toward a teacher.
- :mod:`~robopolicy.refine.residual`: the residual policy (base + residual) and its checkpoint;
  :func:`~robopolicy.refine.residual.load_any_policy` loads any checkpoint directory.
- :mod:`~robopolicy.refine.common`: rollout envs, running reward scale, GAE, evaluation, curves.
"""
