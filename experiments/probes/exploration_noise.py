"""How much residual exploration noise a base policy takes before it stops succeeding.

    .venv/bin/python experiments/probes/exploration_noise.py base=outputs/train/arm_state_50/final
    .venv/bin/python experiments/probes/exploration_noise.py base=CKPT config=experiments/configs/refine/residual_ppo_pp_state.yaml \\
        "log_stds=[-1.0,-2.0,-3.0]" episodes=50
    .venv/bin/python experiments/probes/exploration_noise.py base=CKPT "log_stds=[-2.0,[-2,-2,-2,-2,-2,-0.5]]"   # per dimension

Runs the base as residual PPO's rollouts do (its chunk queue, ``execute_steps`` per chunk) with
an untrained residual whose samples are Gaussian noise of each ``log_std`` (in residual units,
then times ``residual.scale`` / ``scale_per_dim``; a level may be a list, one log-std per action
dimension, like ``residual.log_std_per_dim``), on the evaluation seeds, and prints the
success rate per noise level beside the noiseless base (the anchor). A level that drops success
far below the base is too much exploration for PPO to start from.

With ``repeats=R`` every noise level runs the same layouts R times with fresh noise and also
reports the share of layouts whose outcome differs between repeats. Under a sparse reward only
those carry a policy-gradient signal: a layout that always succeeds (or always fails) whatever
the noise gives every sampled correction the same return.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from robopolicy.config import load_config  # noqa: E402


@dataclass
class NoiseBenchConfig:
    base: str = ""
    """Base policy checkpoint."""
    config: str = "experiments/configs/refine/residual_ppo_pp_state.yaml"
    """Residual PPO config: env, residual scale and execute steps."""
    log_stds: list[float | list[float]] = field(default_factory=lambda: [-1.0, -2.0, -3.0])
    """Noise levels: one log-std for every action dimension, or a list with one per dimension."""
    episodes: int = 50
    envs: int = 2
    seed: int = 100_000
    threads: int = 1
    repeats: int = 1
    """Runs of the same layouts per noise level (>= 2 also reports the layouts whose outcome varies)."""


def main(argv: list[str]) -> int:
    from robopolicy.eval.episodes import evaluate_success
    from robopolicy.refine.residual_ppo import ResidualPPOConfig, build_policy, env_kwargs

    cfg = load_config(NoiseBenchConfig, None, argv)
    if not cfg.base:
        raise SystemExit("give base=CHECKPOINT")
    torch.set_num_threads(cfg.threads)
    rcfg = load_config(ResidualPPOConfig, cfg.config, [f"base={cfg.base}"])
    policy = build_policy(rcfg)
    gen = torch.Generator().manual_seed(0)
    rows = []
    if cfg.repeats < 1:
        raise SystemExit("repeats must be >= 1")
    a_dim = policy.action_loc.shape[0]
    for log_std in [None, *cfg.log_stds]:
        if isinstance(log_std, list) and len(log_std) != a_dim:
            raise SystemExit(f"log_stds entry {log_std} has {len(log_std)} values, the action {a_dim}")
        std = None if log_std is None else torch.as_tensor(np.exp(np.broadcast_to(log_std, (a_dim,))), dtype=torch.float32)

        def act(obs, std=std):
            _, base_norm = policy.residual_input(obs)
            noise = torch.zeros_like(base_norm) if std is None else torch.randn(base_norm.shape, generator=gen) * std
            return policy.env_action(base_norm, policy.hold(noise)).numpy()  # residual.decision: chunk holds it
        outcomes = []  # (repeats, episodes): success of each layout in each repeat
        for _ in range(1 if log_std is None else cfg.repeats):
            res = evaluate_success(act, policy.reset, rcfg.env, cfg.episodes, cfg.envs, cfg.seed, **env_kwargs(rcfg))
            outcomes.append([bool(r["success"]) for r in res.records])
        won = np.array(outcomes)
        varies = float(np.mean(won.any(0) & ~won.all(0))) if len(won) > 1 else float("nan")
        name = "none (base)" if log_std is None else (f"{log_std:+.1f}" if not isinstance(log_std, list)
                                                      else "[" + ", ".join(f"{v:+.1f}" for v in log_std) + "]")
        rows.append((name, float(won.mean()), varies))
        extra = f", outcome varies on {varies:.0%} of the layouts" if len(won) > 1 else ""
        print(f"[noise] log_std {rows[-1][0]}: success {rows[-1][1]:.0%}{extra}", flush=True)
    base = rows[0][1]
    runs = f"{cfg.episodes} layouts x {cfg.repeats}" if cfg.repeats > 1 else f"{cfg.episodes} episodes"
    print(f"\n| residual log-std | success ({runs}) | vs base | layouts whose outcome varies |\n|---|---:|---:|---:|")
    for name, sr, varies in rows:
        ratio = f"{sr / base:.2f}x" if base > 0 else "—"
        print(f"| {name} | {sr:.0%} | {ratio} | {'—' if np.isnan(varies) else f'{varies:.0%}'} |")
    print(f"\nbase {cfg.base}: {base:.0%} without noise; residual scale {[round(v, 3) for v in policy.step_scale.tolist()]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
