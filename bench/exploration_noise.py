"""How much residual exploration noise a base policy takes before it stops succeeding.

    .venv/bin/python bench/exploration_noise.py base=outputs/train/arm_state_50/final
    .venv/bin/python bench/exploration_noise.py base=CKPT config=configs/refine/residual_ppo_pp_state.yaml \\
        "log_stds=[-1.0,-2.0,-3.0]" episodes=50

Runs the base as residual PPO's rollouts do (its chunk queue, ``execute_steps`` per chunk) with
an untrained residual whose samples are Gaussian noise of each ``log_std`` (in residual units,
then times ``residual.scale`` / ``scale_per_dim``), on the evaluation seeds, and prints the
success rate per noise level beside the noiseless base (the anchor). A level that drops success
far below the base is too much exploration for PPO to start from.
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
    config: str = "configs/refine/residual_ppo_pp_state.yaml"
    """Residual PPO config: env, residual scale and execute steps."""
    log_stds: list[float] = field(default_factory=lambda: [-1.0, -2.0, -3.0])
    episodes: int = 50
    envs: int = 2
    seed: int = 100_000
    threads: int = 1


def main(argv: list[str]) -> int:
    from robopolicy.refine.common import evaluate_success
    from robopolicy.refine.residual_ppo import ResidualPPOConfig, build_policy, env_kwargs

    cfg = load_config(NoiseBenchConfig, None, argv)
    if not cfg.base:
        raise SystemExit("give base=CHECKPOINT")
    torch.set_num_threads(cfg.threads)
    rcfg = load_config(ResidualPPOConfig, cfg.config, [f"base={cfg.base}"])
    policy = build_policy(rcfg)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for log_std in [None, *cfg.log_stds]:
        def act(obs, log_std=log_std):
            _, base_norm = policy.residual_input(obs)
            noise = torch.zeros_like(base_norm) if log_std is None else \
                torch.randn(base_norm.shape, generator=gen) * float(np.exp(log_std))
            return policy.env_action(base_norm, noise).numpy()
        res = evaluate_success(act, policy.reset, rcfg.env, cfg.episodes, cfg.envs, cfg.seed, **env_kwargs(rcfg))
        rows.append(("none (base)" if log_std is None else f"{log_std:+.1f}", res.success))
        print(f"[noise] log_std {rows[-1][0]}: success {res.success:.0%}", flush=True)
    base = rows[0][1]
    print(f"\n| residual log-std | success ({cfg.episodes} episodes) | vs base |\n|---|---:|---:|")
    for name, sr in rows:
        print(f"| {name} | {sr:.0%} | {sr / base:.2f}x |" if base > 0 else f"| {name} | {sr:.0%} | — |")
    print(f"\nbase {cfg.base}: {base:.0%} without noise; residual scale {[round(v, 3) for v in policy.step_scale.tolist()]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
