"""A refinement run's ``summary.json``: the run record of :mod:`robopolicy.utils.records` with the
method's own summary (success before / after, env steps, checkpoints, ...) as its metrics."""

from __future__ import annotations

from pathlib import Path


def write_refine_summary(cfg, metrics: dict, started: float) -> Path:
    """``<out>/summary.json``: the run record (:mod:`robopolicy.utils.records`: commit, config
    digest, seeds, machine, wall time; episodes: those of each evaluation) with the method's own
    summary as its metrics."""
    from robopolicy.utils.records import write_summary

    return write_summary(cfg.out, kind="refine", config=cfg, seeds=[cfg.seed],
                         episodes=cfg.eval_episodes, metrics=metrics, started_at=started)


def read_refine_summary(out_dir: str | Path) -> dict | None:
    """The method's summary (the record's metrics) of a finished run in ``out``; ``None`` when
    none finished there. A summary written before runs wrote records is the method's summary itself."""
    import json

    from robopolicy.utils.records import SUMMARY_NAME

    path = Path(out_dir) / SUMMARY_NAME
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data["metrics"] if "schema" in data and isinstance(data.get("metrics"), dict) else data
