"""Residual PPO in stages from one command: each stage starts from the previous stage's residual.

    # in a residual PPO config: the first stage's settings, then what changes in each later stage
    stages:
      - {total_env_steps: 600000, actor_lr: 2.0e-4, residual: {log_std: -1.0}, final_log_std: -1.5}
      - {total_env_steps: 400000, gamma: 0.8, gae_lambda: 0.8}

    robopolicy refine --method residual-ppo --base CKPT --env ID --config that.yaml

Stage k+1 is the first stage's config with its mapping merged in (nested keys merge, as with
overrides), its ``init_residual`` stage k's ``final/`` and its ``out`` ``<out>/stage<k+1>``;
the first stage starts from the config's own ``init_residual`` (empty: the base). Every stage's
config is built before the first stage runs, so a wrong key in the last stage fails at once and
not after hours of the first ones. A stage that sets its own ``seed`` keeps it whatever the first
stage's is (``seed=N`` on the command line changes the first stage's and those of the stages that
set none); each stage's seed is in its log line and its ``refine_config.yaml``.

A stage whose directory already holds a finished run with the same settings (``summary.json``
beside a ``refine_config.yaml`` that loads to the same config) is not run again, so a chain that
stopped goes on from its last finished stage; a directory holding a finished run with other
settings is refused (choose another ``out``). The chain writes ``out/curve.csv`` and
``curve.png`` (every stage's evaluations over the chain's env steps, with a ``stage`` column),
``out/summary.json`` (each stage's summary and the chain's before, after, env steps, steps to
80%); ``robopolicy refine`` writes the chain's own ``out/refine_config.yaml`` as for any run.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

from robopolicy.config import ConfigError, build, deep_merge, load_config, to_dict
from robopolicy.refine import residual_ppo
from robopolicy.refine.common import Curve, save_run_config
from robopolicy.refine.summary import read_refine_summary, write_refine_summary

CHAIN_KEYS = ("stages", "init_residual", "out", "out_dir")
"""Settings the chain sets for every stage; a stage's mapping may not name them (``out_dir``: the old
name of ``out``)."""


def stage_configs(cfg: residual_ppo.ResidualPPOConfig) -> list[residual_ppo.ResidualPPOConfig]:
    """The configs of the chain's stages, the first one included, each checked whole."""
    data = to_dict(cfg)
    data["stages"] = []
    root = Path(cfg.out)
    configs, start = [], cfg.init_residual
    for k, change in enumerate([{}, *cfg.stages], start=1):
        where = f"stage {k} (stages[{k - 2}])" if k > 1 else "stage 1 (the config itself)"
        if not isinstance(change, Mapping):
            raise ConfigError(f"{where}: a stage is a mapping of the settings it changes, got {change!r}")
        named = [key for key in CHAIN_KEYS if key in change]
        if named:
            raise ConfigError(f"{where}: '{named[0]}' is set by the chain for every stage "
                              f"(init_residual: the previous stage's final/; out: <out>/stage<k>)")
        stage = deep_merge(data, change)
        stage.update(init_residual=start, out=str(root / f"stage{k}"))
        configs.append(build(type(cfg), stage, where))
        start = str(root / f"stage{k}" / "final")
    return configs


def finished(cfg: residual_ppo.ResidualPPOConfig) -> dict | None:
    """The summary of a finished run of exactly ``cfg`` in its ``out``; ``None`` when none ran
    there (or it stopped before its summary). A finished run of other settings is refused."""
    out = Path(cfg.out)
    summary = read_refine_summary(out)
    if summary is None:
        return None
    saved = out / "refine_config.yaml"
    if not saved.is_file() or to_dict(load_config(type(cfg), saved)) != to_dict(cfg):
        raise ConfigError(f"{out} holds a finished run with other settings than this stage's; "
                          f"choose another out or remove it")
    return summary


def train(cfg: residual_ppo.ResidualPPOConfig, method: str = "residual-ppo", log: Callable[[str], None] = print) -> dict:
    """Run the chain's stages in order (see the module docstring) and return the chain's summary.
    ``method`` (``residual-ppo`` or ``ppo``) heads each stage's saved config."""
    configs = stage_configs(cfg)
    root = Path(cfg.out)
    t0, started = time.perf_counter(), time.time()
    chain = Curve(root, "curve")
    summaries, offset = [], 0
    for k, stage in enumerate(configs, start=1):
        summary = finished(stage)
        if summary is not None:
            log(f"[stages] stage {k}/{len(configs)}: finished already in {stage.out}, not run again")
        else:
            log(f"[stages] stage {k}/{len(configs)}: {stage.total_env_steps} env steps, seed {stage.seed}"
                f"{f' from {stage.init_residual}' if stage.init_residual else ''} -> {stage.out}")
            save_run_config(method, stage)
            summary = residual_ppo.train(stage, log=log)
        with open(Path(stage.out) / "curve.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        for i, row in enumerate(rows):
            if k > 1 and i == 0:
                continue  # a later stage's start is the previous stage's end
            chain.rows.append({"env_steps": offset + int(row["env_steps"]), "success": float(row["success"]),
                               "stage": k})
        offset += int(summary["env_steps"])
        summaries.append({"stage": k, "out": stage.out, **summary})
    chain.save()
    result = {"before": summaries[0]["before"], "after": summaries[-1]["after"], "env_steps": offset,
              "steps_to_80": chain.steps_to(0.8), "seconds": time.perf_counter() - t0,
              "checkpoint": summaries[-1]["checkpoint"], "stages": summaries,
              "curve_csv": str(root / "curve.csv"), "curve_png": str(root / "curve.png")}
    write_refine_summary(cfg, result, started)
    return result
