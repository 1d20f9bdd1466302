"""Evaluation results: per-split summaries, JSON and a markdown table.

Metrics come from ``sim_envs`` only (``sim_envs.rollout.summarize``, which uses
``sim_envs.person_follow.metrics`` for tracking): this module arranges them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sim_envs.rollout import EpisodeResult, summarize


@dataclass
class SplitResult:
    """One env configuration (a PersonFollow split, or the env itself) evaluated on N seeds."""

    label: str
    split: str | None
    summary: dict[str, float]
    episodes: list[dict[str, Any]]
    seconds: float
    env_steps: int
    policy_calls: int
    policy_ms_per_call: float
    videos: list[str] = field(default_factory=list)
    reruns: int = 0
    """Episodes run again because their env worker died (``backend: ray``)."""
    start_seconds: float = 0.0
    """Of ``seconds``, the workers' start: env processes (local) or Ray workers loading the policy
    and building their env (``backend: ray``); ``env_steps / (seconds - start_seconds)`` is the
    rate once they run."""

    @property
    def steps_per_s(self) -> float:
        return self.env_steps / self.seconds if self.seconds > 0 else 0.0


def summarize_split(env_id: str, episodes: list[dict[str, Any]], fps: float | None = None) -> dict[str, float]:
    """The task's summary over episode records (as produced by ``EvalEpisode``).

    PersonFollow: success / tracking / collision / lost / wrong-target rates (and, with
    ``instruction=swap``, the share of retargeted episodes). Other tasks: success rate and mean
    steps to success (plus seconds when ``fps`` is known), the mean return, and PickPlace's
    wrong-object rate.
    """
    results = [
        EpisodeResult(seed=int(e["seed"]), steps=int(e["steps"]), success=bool(e["success"]),
                      episode_metrics=dict(e.get("episode_metrics") or {}), task=str(e.get("task", "")), seconds=0.0)
        for e in episodes
    ]
    summary = dict(summarize(env_id, results))
    if "tracking_rate" not in summary and episodes:
        summary["mean_return"] = sum(float(e.get("return", 0.0)) for e in episodes) / len(episodes)
        steps = summary.get("mean_steps_to_success", float("nan"))
        if fps and isinstance(steps, float) and math.isfinite(steps):
            summary["mean_time_to_success_s"] = steps / fps
    return summary


def _pct(value: Any) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100.0 * value:.1f}"


def _num(value: Any, digits: int = 1) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


@dataclass
class EvalReport:
    """All splits of one evaluation run."""

    env_id: str
    checkpoint: str
    seed: int
    splits: list[SplitResult]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def instruction(self) -> str:
        """The instruction mode of the run (``normal``, ``swap`` or ``blank``)."""
        return str(self.config.get("instruction", "normal"))

    @property
    def tracking(self) -> bool:
        return any("tracking_rate" in s.summary for s in self.splits)

    def table(self) -> str:
        """Markdown table, one row per split (rates in %)."""
        if self.tracking:
            head = ["split", "episodes", "SR %", "TR %", "CR %", "CR person %", "lost %", "wrong target %",
                    "policy ms/call", "env steps/s"]
            rows = [[s.split or s.label, str(s.summary.get("episodes", 0)), _pct(s.summary.get("success_rate")),
                     _pct(s.summary.get("tracking_rate")), _pct(s.summary.get("collision_rate")),
                     _pct(s.summary.get("person_collision_rate")), _pct(s.summary.get("lost_rate")),
                     _pct(s.summary.get("wrong_target_rate")), _num(s.policy_ms_per_call), _num(s.steps_per_s)]
                    for s in self.splits]
            if self.instruction == "swap":
                head.insert(-2, "retargeted %")
                for row, s in zip(rows, self.splits):
                    row.insert(-2, _pct(s.summary.get("retargeted_rate")))
        else:
            head = ["task", "episodes", "success %", "steps to success", "time to success s", "mean return",
                    "policy ms/call", "env steps/s"]
            rows = [[s.label, str(s.summary.get("episodes", 0)), _pct(s.summary.get("success_rate")),
                     _num(s.summary.get("mean_steps_to_success")), _num(s.summary.get("mean_time_to_success_s"), 2),
                     _num(s.summary.get("mean_return"), 2), _num(s.policy_ms_per_call), _num(s.steps_per_s)]
                    for s in self.splits]
            if any("wrong_object_rate" in s.summary for s in self.splits):
                head.insert(3, "wrong object %")
                for row, s in zip(rows, self.splits):
                    row.insert(3, _pct(s.summary.get("wrong_object_rate")))
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for split, data in zip(self.splits, out["splits"]):
            data["steps_per_s"] = split.steps_per_s
        return _nan_to_none(out)

    def save(self, out_dir: str | Path) -> tuple[Path, Path]:
        """Write ``eval.json`` and ``eval.md`` under ``out_dir``; returns both paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        js, md = out / "eval.json", out / "eval.md"
        js.write_text(json.dumps(self.to_dict(), indent=2, default=_json_safe, allow_nan=False) + "\n")
        header = f"# Evaluation: {Path(self.checkpoint).name or self.checkpoint} on {self.env_id}\n\n"
        seeds = f"\nSeeds {self.seed}.. (episode i uses seed {self.seed} + i, the same for every split).\n"
        mode = "" if self.instruction == "normal" else f"Instruction: {self.instruction}.\n\n"
        md.write_text(header + mode + self.table() + "\n" + seeds)
        return js, md


def _json_safe(value: Any) -> Any:
    return str(value)


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj
