"""What a fleet run leaves behind: ``episodes.csv`` (one row per ingested episode, with the weight
version it ran), ``versions.csv``, ``success.png`` (the policy's own success, from the episodes
run without the operator, and the operator's share of the steps, against wall clock) and
``summary.json``."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Callable

import numpy as np


def _write_csv(path: Path, rows: list[dict]) -> None:
    from robopolicy.utils.files import atomic_file

    if not rows:
        return
    with atomic_file(path) as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def moving(values: list[float], window: int) -> np.ndarray:
    """The mean of each value with the ``window - 1`` before it (fewer at the start)."""
    v = np.asarray(values, float)
    c = np.concatenate([[0.0], np.cumsum(v)])
    idx = np.arange(1, len(v) + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def plot(rows: list[dict], versions: list[dict], window: int, path: Path, title: str,
         version_success: list[dict] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from robopolicy.utils.files import atomic_file

    evals = [r for r in rows if r["eval"]]
    driven = [r for r in rows if not r["eval"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    if evals:
        ax.plot([r["wall_s"] / 60 for r in evals], moving([r["success"] for r in evals], window),
                label=f"success without the operator (mean of {window} episodes)")
    if driven:
        share = [r["intervention_frames"] / max(1, r["frames"]) for r in driven]
        ax.plot([r["wall_s"] / 60 for r in driven], moving(share, 4 * window), alpha=0.7,
                label=f"operator's share of the steps (mean of {4 * window} episodes)")
    for v in versions[1:]:
        ax.axvline(v["wall_s"] / 60, color="0.85", lw=0.8, zorder=0)
    if version_success:
        when = {int(v["version"]): float(v["wall_s"]) / 60 for v in versions}
        pts = [(when[r["version"]], r["success"]) for r in version_success if r["version"] in when]
        ax.plot(*zip(*pts), "o-", color="black", ms=4,
                label=f"each version alone, the same {version_success[0]['episodes']} seeds (at its publishing time)")
    ax.set_xlabel("wall clock (min); grey lines: new weight versions")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def success_ends(rows: list[dict], window: int) -> tuple[float | None, float | None]:
    """The policy's own success over the first and the last ``window`` evaluation episodes."""
    evals = [float(r["success"]) for r in rows if r["eval"]]
    if not evals:
        return None, None
    return float(np.mean(evals[:window])), float(np.mean(evals[-window:]))


def report(cfg, learner, pool, actors_made: int, started: float, wall_s: float, log: Callable[[str], None]) -> dict:
    """Write the run's files and ``summary.json``; log the one-line summary; return the metrics."""
    from robopolicy.utils.records import write_summary

    out = Path(cfg.out)
    rows, st = learner.rows, learner.stats
    _write_csv(out / "episodes.csv", rows)
    _write_csv(out / "versions.csv", learner.versions)
    plot(rows, learner.versions, cfg.window, out / "success.png", f"fleet of {cfg.actors} on {cfg.env.label()}")
    first, last = success_ends(rows, cfg.window)
    ingest_min = max(1e-9, rows[-1]["wall_s"] if rows else 0.0) / 60
    metrics: dict[str, Any] = {
        "episodes": st.episodes, "eval_episodes": sum(r["eval"] for r in rows), "frames": st.frames,
        "labels": st.labels, "aggregate_labels": learner.aggregate, "versions": learner.version, "train_steps": learner.train_steps,
        "train_s": round(learner.train_s, 2), "episodes_rerun": pool.reruns, "actors_replaced": pool.replaced,
        "actors_started": actors_made, "success_first": first, "success_last": last,
        "gain_pts": None if first is None else round(100 * (last - first), 1),
        "intervention_share": round(sum(r["intervention_frames"] for r in rows) / max(1, st.frames), 4),
        "episodes_per_min": round(st.episodes / ingest_min, 1),
        "queue_wait_ms_median": round(1000 * float(np.median(st.queue_wait_s)), 2) if st.queue_wait_s else None,
        "commit_ms_median": round(1000 * float(np.median(st.commit_s)), 2) if st.commit_s else None,
        "robot_wait_s": round(st.submit_wait_s, 3), "window": cfg.window,
        "dataset": str(learner.dataset) if learner.dataset else None,
        "versions_by_episode_ok": all(0 <= r["version"] <= learner.version for r in rows),
    }
    write_summary(out, kind="fleet", config=cfg, seeds=cfg.seed, episodes=st.episodes, metrics=metrics,
                  wall_time_s=wall_s, started_at=started)
    fmt = (lambda x: "n/a" if x is None else f"{x:.0%}")
    log(f"[fleet] {st.episodes} episodes from {cfg.actors} actors in {wall_s / 60:.1f} min | v{learner.version} | "
        f"labels {st.labels} | success {fmt(first)} -> {fmt(last)} (first/last {cfg.window} eval episodes) | "
        f"rerun {pool.reruns} | {out / 'success.png'}")
    return metrics


def read_csv(path: Path) -> list[dict]:
    """Rows of a CSV this module wrote, numbers and booleans parsed."""
    def value(text: str):
        if text in ("True", "False"):
            return text == "True"
        try:
            return float(text) if any(c in text for c in ".en") else int(text)
        except ValueError:
            return None if text == "" else text

    with open(path, newline="") as fh:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(fh)]


def report_versions(cfg, results: list[dict], episodes: int, started: float, log: Callable[[str], None]) -> dict:
    """``versions_eval.csv``, ``success.png`` redrawn with the versions' points, and the record."""
    from robopolicy.utils.records import write_summary

    out = Path(cfg.out)
    versions = read_csv(out / "versions.csv")
    rows = read_csv(out / "episodes.csv") if (out / "episodes.csv").exists() else []
    when = {int(v["version"]): float(v["wall_s"]) for v in versions}
    table = [{**r, "episodes": episodes, "wall_s": when.get(r["version"])} for r in results]
    _write_csv(out / "versions_eval.csv", table)
    plot(rows, versions, cfg.window, out / "success.png", f"fleet of {cfg.actors} on {cfg.env.label()}", table)
    first, last = table[0]["success"], table[-1]["success"]
    best = max(table, key=lambda r: r["success"])
    metrics = {"episodes_per_version": episodes, "seeds_from": cfg.version_seed, "versions": table,
               "success_v0": first, "success_last": last, "last_version": table[-1]["version"],
               "gain_pts": round(100 * (last - first), 1), "best_version": best["version"], "best_success": best["success"],
               "run_wall_s_at_last": table[-1]["wall_s"]}
    write_summary(out / "versions_eval", kind="eval", config=cfg, seeds=cfg.version_seed, episodes=episodes * len(table),
                  metrics=metrics, started_at=started)
    log(f"[fleet] versions on the same {episodes} seeds: v0 {first:.1%} -> v{table[-1]['version']} {last:.1%} "
        f"({metrics['gain_pts']:+.1f} pts); {out / 'success.png'}")
    return metrics
