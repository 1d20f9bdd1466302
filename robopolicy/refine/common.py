"""Pieces shared by the refinement loops: the run options every method's config has, the saved run
config and the success curve.

The other shared pieces live with their owners: rollout envs and the evaluation loop in
:mod:`robopolicy.eval` (:func:`robopolicy.eval.envs.make_task_envs`,
:func:`robopolicy.eval.episodes.evaluate_success`), the task wrappers (reward mode, privileged
state, oracle labels) in :mod:`sim_envs.wrappers`, PPO and GAE in :mod:`robopolicy.rl`.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass
class RefineRunOptions:
    """What every refinement loop's config shares: evaluation episodes, seeds, threads, output."""

    eval_episodes: int = 20
    """Episodes of each evaluation (before training, every ``eval_every`` env steps, at the end)."""
    eval_envs: int = 2
    """Envs an evaluation runs at once."""
    eval_seed: int = 100_000
    """Episode ``e`` of an evaluation starts from seed ``eval_seed + e`` (as ``robopolicy eval``)."""
    seed: int = 0
    """Seed of torch, of the learner and of the training envs (env ``i`` resets with ``seed + i``)."""
    threads: int = 1
    """Torch threads of the learner (0: torch's default)."""
    out: str = "outputs/refine/run"
    """Where the run writes its curve, checkpoints and ``summary.json``."""
    progress: bool = True
    """Show a progress bar."""


def save_run_config(method: str, cfg) -> Path:
    """``<out>/refine_config.yaml``: every setting of a run as resolved (config file, overrides,
    defaults), so ``robopolicy refine --method M --config <it>`` runs it again. Written whole or
    not at all, before the run starts."""
    import json

    import yaml

    from robopolicy.config import to_dict
    from robopolicy.utils.files import atomic_write_text

    text = (f"# robopolicy refine --method {method} --config <this file> runs it again\n"
            + yaml.safe_dump(json.loads(json.dumps(to_dict(cfg))), sort_keys=False))
    return atomic_write_text(Path(cfg.out) / "refine_config.yaml", text)


class Curve:
    """Success vs environment steps, written as CSV and PNG."""

    def __init__(self, out_dir: str | Path, name: str = "curve"):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.rows: list[dict[str, float]] = []

    def add(self, env_steps: int, success: float, **extra: float) -> None:
        self.rows.append({"env_steps": int(env_steps), "success": float(success), **extra})
        self.save()

    def steps_to(self, level: float) -> int | None:
        """First env-step count at which success reached ``level`` (``None``: never)."""
        return next((int(r["env_steps"]) for r in self.rows if r["success"] >= level), None)

    def best(self) -> dict[str, float] | None:
        """The evaluation with the highest success after the first row (the starting policy), the
        earliest on ties; ``None`` before any. The curve need not rise, so a run keeps this point's
        policy beside its final one."""
        return max(self.rows[1:], key=lambda r: r["success"], default=None)

    def is_best(self) -> bool:
        """Whether the last evaluation is :meth:`best` (the one to save as ``best/``)."""
        return len(self.rows) > 1 and self.best() is self.rows[-1]

    def best_summary(self, above: float = float("-inf")) -> dict:
        """Summary fields of :meth:`best` and its checkpoint (``best/`` beside the curve); all ``None``
        when there is none or its success is not above ``above``."""
        best = self.best()
        if best is None or best["success"] <= above:
            return {"best": None, "best_env_steps": None, "best_checkpoint": None}
        return {"best": best["success"], "best_env_steps": int(best["env_steps"]),
                "best_checkpoint": str(self.out / "best")}

    def save(self) -> tuple[Path, Path | None]:
        csv_path = self.out / f"{self.name}.csv"
        keys = list(dict.fromkeys(k for r in self.rows for k in r))
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)
        return csv_path, plot_curves({self.name: self.rows}, self.out / f"{self.name}.png")


def plot_curves(curves: dict[str, Sequence[dict]], path: str | Path, title: str = "success vs env steps") -> Path | None:
    """One line per named curve (rows with ``env_steps`` and ``success``); ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in curves.items():
        if rows:
            ax.plot([r["env_steps"] for r in rows], [r["success"] for r in rows], marker="o", label=name)
    ax.set_xlabel("environment steps")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
