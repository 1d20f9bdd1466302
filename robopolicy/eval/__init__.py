"""Policy evaluation in simulation (``robopolicy eval``).

- :mod:`~robopolicy.eval.config`: ``EvalConfig`` (env, splits, seeds, chunk execution, env mapping)
- :mod:`~robopolicy.eval.envs`: the wrapped env each worker runs (no torch) and the one vector-env
  factory, also refinement's (task envs with ``sim_envs.wrappers``)
- :mod:`~robopolicy.eval.episodes`: the one evaluation loop (``run_episodes``; refinement's
  ``evaluate_success``)
- :mod:`~robopolicy.eval.policy_runner`: batching observations for ``Policy.predict``; ``PolicyActor``
  runs a policy's chunks through the chunk executor (:mod:`hardware.control.chunking`)
- :mod:`~robopolicy.eval.rollout`: ``evaluate(policy, cfg) -> EvalReport``
- :mod:`~robopolicy.eval.report`: per-split summaries, JSON, markdown table

Only the config is imported here: env worker processes import this package without torch.
"""

from robopolicy.eval.config import ChunkConfig, EnvMapping, EvalConfig

__all__ = ["ChunkConfig", "EnvMapping", "EvalConfig", "evaluate"]


def __getattr__(name: str):
    if name == "evaluate":
        from robopolicy.eval.rollout import evaluate

        return evaluate
    raise AttributeError(name)
