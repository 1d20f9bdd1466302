"""Refinement in simulation, one readable module per method (CleanRL style).

- :mod:`~robopolicy.refine.residual_ppo`: PPO on a small closed-loop residual over a frozen base
  policy (ResiP); without a base the same loop is PPO from scratch.
- :mod:`~robopolicy.refine.residual_td3`: the same residual trained off-policy (TD3 from a replay
  buffer, sparse reward, semi-MDP chunk decisions): far fewer env steps where the task allows it.
- :mod:`~robopolicy.refine.dagger`: on-policy relabelling with filtered oracle labels.
- :mod:`~robopolicy.refine.distill`: a privileged teacher (the oracle, or a state policy) labels the
  states a camera student visits; the student is trained on them (DAgger's machinery).
- :mod:`~robopolicy.refine.rpd`: PPO on a compact student plus an annealed BC term toward a teacher.
- :mod:`~robopolicy.refine.residual`: the residual policy (a frozen base's executed chunks, an
  actor-critic from :mod:`robopolicy.rl`, the action adapters of
  :mod:`~robopolicy.refine.adapters`) and its checkpoint, which ``robopolicy.models.load_policy`` loads;
  :mod:`~robopolicy.refine.scratch`: the policy learnt without a base (PPO from scratch, RPD's student);
  :mod:`~robopolicy.refine.residual_run`: what residual PPO and residual TD3 share.
- :mod:`~robopolicy.refine.stages`: residual PPO in stages from one command.
- :mod:`~robopolicy.refine.common`: the run options every method shares, curves, the saved run
  config; :mod:`~robopolicy.refine.summary`: the run's ``summary.json``.

The PPO update, GAE, the actor-critic and the running statistics are :mod:`robopolicy.rl`'s; rollout
envs and the evaluation loop :mod:`robopolicy.eval`'s; the task wrappers :mod:`sim_envs.wrappers`'.
"""
