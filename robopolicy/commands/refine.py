"""``robopolicy refine``: refine a policy in simulation (residual PPO / TD3, DAgger, RPD) or train PPO from scratch.

    robopolicy refine --method residual-ppo --checkpoint outputs/train/arm_pp/final --env robopolicy/ArmPickPlace-v0 \\
        --config configs/refine/residual_ppo/arm.yaml total_env_steps=50000
    robopolicy refine --method residual-td3 --checkpoint outputs/train/arm_reach_state_10/final --env robopolicy/ArmReach-v0 \\
        --config configs/refine/residual_td3/reach_state.yaml
    robopolicy refine --method ppo --env robopolicy/ArmPickPlace-v0 --config configs/refine/ppo/arm.yaml
    robopolicy refine --method dagger --checkpoint outputs/train/pf_staged/final --env robopolicy/PersonFollow-v0 --split dt \\
        --config configs/refine/dagger/track.yaml
    robopolicy refine --method rpd --checkpoint outputs/train/arm_reach/final --env robopolicy/ArmReach-v0 \\
        --config configs/refine/rpd/arm.yaml
    robopolicy refine --method distill --teacher oracle --student-config configs/train/arm/chunk_l1.yaml \\
        --config configs/refine/distill/pushcube.yaml

Each run writes ``<out>/refine_config.yaml`` (the resolved config, the method in its first line,
before the run starts: a run can be read back and rerun; with ``stages``, see
:mod:`robopolicy.refine.stages`), ``<out>/curve.csv`` and ``curve.png``
(success vs env steps), ``summary.json``, the refined checkpoint ``<out>/final`` and prints a
before / after table.
"""

from __future__ import annotations

import argparse
import sys

from robopolicy.config import ConfigError

METHODS = ("residual-ppo", "residual-td3", "ppo", "dagger", "hg-dagger", "rpd", "world-model", "distill")
NEEDS_BASE = {"residual-ppo": " (or use --method ppo)", "residual-td3": "", "dagger": "", "hg-dagger": "",
              "rpd": " (the teacher)"}
"""The methods that refine (or distil) a checkpoint given by --checkpoint, and what their error adds."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("refine", help="refine a policy in simulation: residual PPO / TD3, DAgger, RPD (or PPO from scratch)")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--checkpoint", help="policy checkpoint to refine (the frozen base of residual-ppo / residual-td3, "
                   "the policy DAgger trains on) or the teacher (rpd); sets the config's 'base'")
    p.add_argument("--base", help=argparse.SUPPRESS)  # the old name of --checkpoint
    p.add_argument("--env", help="env id, e.g. robopolicy/ArmPickPlace-v0, or module:EnvId (the module is imported)")
    p.add_argument("--split", help="PersonFollow split (stt, dt, at)")
    p.add_argument("--teacher", help="distill: 'oracle' (the env's scripted oracle) or a state policy checkpoint")
    p.add_argument("--student-config", help="distill: training config whose model section is the camera student")
    p.add_argument("--out", help="output directory")
    p.add_argument("--config", help="YAML config of the method")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_refine)


def config_class(method: str) -> type:
    """The config dataclass a refine method loads (imported here, so ``robopolicy --help`` needs no torch)."""
    if method in ("residual-ppo", "ppo"):
        from robopolicy.refine.residual_ppo import ResidualPPOConfig as cls
    elif method == "residual-td3":
        from robopolicy.refine.residual_td3 import ResidualTD3Config as cls
    elif method == "dagger":
        from robopolicy.refine.dagger import DAggerConfig as cls
    elif method == "hg-dagger":
        from robopolicy.teleop.hg_dagger import HGDAggerConfig as cls
    elif method == "rpd":
        from robopolicy.refine.rpd import RPDConfig as cls
    elif method == "world-model":
        from robopolicy.world.imagine import WorldRefineConfig as cls
    elif method == "distill":
        from robopolicy.refine.distill import DistillConfig as cls
    else:
        raise ValueError(f"unknown refine method {method!r}; one of {METHODS}")
    return cls


def _overrides(args: argparse.Namespace) -> list[str]:
    out = []
    if args.base:
        print("robopolicy refine: --base is deprecated, use --checkpoint", file=sys.stderr)
        if args.checkpoint and args.checkpoint != args.base:
            raise ConfigError("both --checkpoint and --base (its old name) are given: keep --checkpoint")
    checkpoint = args.checkpoint or args.base
    if checkpoint:
        out.append(f"base={checkpoint}")
    if args.env:
        out.append(f"env.id={args.env}")
    if args.split:
        out.append(f"env.kwargs.split={args.split}")
    if args.out:
        out.append(f"out={args.out}")
    if args.teacher:
        out.append(f"teacher={args.teacher}")
    if args.student_config:
        out.append(f"student_config={args.student_config}")
    if args.no_progress:
        out.append("progress=false")
    return out + list(args.overrides)


def _steps_to(steps: int | None) -> str:
    """A curve's first env-step count at a success level, for the summary line (0: it started there)."""
    return "not reached" if steps is None else "already at the start" if steps == 0 else str(steps)


def cmd_refine(args: argparse.Namespace) -> int:
    from robopolicy.config import load_config
    from robopolicy.models.policy import PolicyError
    from robopolicy.world.model import WorldModelError

    overrides = _overrides(args)
    try:
        cfg = load_config(config_class(args.method), args.config, overrides)
        if args.method == "ppo" and cfg.base:
            print("robopolicy refine: --method ppo trains from scratch; drop --checkpoint (or use residual-ppo)")
            return 2
        if args.method in NEEDS_BASE and not cfg.base:
            print(f"robopolicy refine: --method {args.method} needs --checkpoint CKPT{NEEDS_BASE[args.method]}")
            return 2
        from robopolicy.refine.common import save_run_config

        save_run_config(args.method, cfg)
        if args.method in ("residual-ppo", "ppo"):
            from robopolicy.refine import residual_ppo

            name = f"start ({cfg.init_residual})" if cfg.init_residual else "base" if cfg.base else "untrained"
            if cfg.stages:
                from robopolicy.refine import stages

                s = stages.train(cfg, args.method)
                rows = [(name, s["before"])] + [
                    (f"after stage {st['stage']} ({st['env_steps']} env steps; {st['checkpoint']})", st["after"])
                    for st in s["stages"]]
            else:
                s = residual_ppo.train(cfg)
                rows = [(name, s["before"]), ("after " + args.method, s["after"])]
            extra = f"env steps to 80% success: {_steps_to(s['steps_to_80'])}"
        elif args.method == "residual-td3":
            from robopolicy.refine import residual_td3

            s = residual_td3.train(cfg)
            rows = [("base", s["before"]), ("after residual-td3", s["after"])]
            extra = (f"env steps to 80% success: {_steps_to(s['steps_to_80'])}; "
                     f"{s['decisions']} decisions, {s['updates']} updates")
        elif args.method == "dagger":
            from robopolicy.refine import dagger

            s = dagger.train(cfg)
            rows = [("base", s["before"], s["before_metrics"]),
                    (f"after DAgger (filter {s['filter'] or 'off'})", s["after"], s["after_metrics"])]
            if s.get("best") is not None and s["best"] > s["after"]:
                rows.append((f"best evaluation ({s['best_env_steps']} env steps; {s['best_checkpoint']})", s["best"]))
            flagged = ", ".join(f"{k} {v}" for k, v in s["flagged_states"].items() if v)
            extra = (f"states kept {s['kept_states']}, dropped by the filter {s['dropped_states']}"
                     f" (flagged: {flagged or 'none'})")
            if s["counterfactual_steps"]:
                extra += f"; the oracle's chunks took {s['counterfactual_steps']} counterfactual steps"
        elif args.method == "hg-dagger":
            from robopolicy.teleop import hg_dagger

            s = hg_dagger.train(cfg)
            rows = [("base", s["before"]), (f"after HG-DAgger ({s['labels']} labels)", s["after"])]
            extra = (f"labels {s['labels']} ({100 * s['label_fraction']:.1f}% of the steps) | gain "
                     f"{s['gain_pts']:+.1f} pts; {s['takeovers']} take-overs, {s['lapses']} lapses")
        elif args.method == "distill":
            from robopolicy.refine import distill

            s = distill.train(cfg)
            rows = [(f"student, iteration {r['iteration']} (beta {r['beta']:.3g}, {r['env_steps']} env steps)",
                     r["success"]) for r in s["iterations"]]
            t = s["seconds_by_phase"]
            extra = (f"teacher {s['teacher']}; {s['iterations_run']} iterations; rollouts {t['rollout']:.0f} s, "
                     f"fine-tuning {t['finetune']:.0f} s, evaluations {t['eval']:.0f} s")
        elif args.method == "world-model":
            from robopolicy.world import imagine

            s = imagine.train(cfg)
            rows = [("start", s["before"]), ("after world-model refinement", s["after"])]
            if s["best"] > s["after"]:
                rows.append((f"best evaluation ({s['best_env_steps']} env steps; {s['best_checkpoint']})", s["best"]))
            extra = (f"env steps to 80% success: {_steps_to(s['steps_to_80'])}; ensemble disagreement "
                     + ("n/a" if s["disagreement"] is None else f"{s['disagreement']:.4f}")
                     + (f"; stopped: {s['stopped']}" if s["stopped"] else ""))
        else:
            from robopolicy.refine import rpd

            s = rpd.train(cfg)
            rows = [("teacher", s["teacher_success"]), ("student before", s["student_before"]),
                    ("student after", s["student_after"])]
            if s.get("student_best") is not None:
                rows.append((f"student, best evaluation ({s['best_env_steps']} env steps; {s['best_checkpoint']})",
                             s["student_best"]))
            extra = (f"teacher {s['teacher_params']:,} params, student {s['student_params']:,} "
                     f"({s['size_ratio']:.0f}x smaller); latency {s['latency_ms']['teacher']:.2f} ms vs "
                     f"{s['latency_ms']['student']:.2f} ms ({s['latency_ratio']:.0f}x)")
    except (PolicyError, WorldModelError) as exc:
        print(f"robopolicy refine: {exc}")
        return 1
    print("\n| policy | success | other |\n|---|---|---|")
    for row in rows:
        other = ", ".join(f"{k} {v:.3f}" for k, v in (row[2] if len(row) > 2 else {}).items())
        print(f"| {row[0]} | {100 * row[1]:.1f}% | {other} |")
    print(f"\n{extra}\nenv steps {s['env_steps']}, {s['seconds']:.0f} s; checkpoint {s['checkpoint']}; "
          f"curve {cfg.out}/curve.png")
    return 0
