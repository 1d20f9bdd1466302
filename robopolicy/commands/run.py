"""``robopolicy run``: drive a robot (simulated or real) with a policy through the control node.

    robopolicy run --robot configs/robots/sim_arm.yaml --policy sine --duration 10
    robopolicy run --robot configs/robots/sim_arm.yaml --checkpoint outputs/train/arm_pp/final --duration 30
    robopolicy run --robot configs/robots/sim_base.yaml --policy arc:v=0.3,omega=0.2
    robopolicy run --config deploy.yaml robot.loop.rate_hz=250
    robopolicy run --robot configs/robots/sim_arm.yaml --checkpoint outputs/train/arm_pp/final \
        --teleop keyboard --dataset data/interventions --task "put the red cube in the green bowl"

``--teleop DEVICE --dataset DIR``: interventions (HG-DAgger). The policy drives; the operator takes
over with the device's button and gives control back; the episodes are recorded with
``intervention`` and the policy's proposal ``policy.action`` (robopolicy.teleop.session, the same
session as ``robopolicy teleop --checkpoint``; ``--config`` and ``key=value`` are then a
TeleopConfig's: episode_s, reset_s, fps, ...). ``--duration`` ends the session.

Exit status: 0, 3 when a fault was latched at the end, 128 + the signal's number when SIGINT
(130), SIGTERM (143) or SIGHUP (129) ended the run; each way runs the safe stop, disconnects the
driver and writes the report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from robopolicy.config import ConfigError, build, deep_merge, load_yaml, parse_overrides
from robopolicy.deploy.run import RunConfig, run


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the real-time control node with a policy worker (sim or real robot)")
    p.add_argument("--config", help="YAML RunConfig (robot, policy, duration, report)")
    p.add_argument("--robot", help="YAML robot config (configs/robots/*.yaml); replaces the config's robot")
    p.add_argument("--checkpoint", help="policy checkpoint directory to run")
    p.add_argument("--policy", help="scripted source instead of a checkpoint: hold, sine[:amp=..], arc[:v=..], "
                   "replay:FILE.npz")
    p.add_argument("--duration", type=float, help="seconds to run (default: until q + Enter or Ctrl-C)")
    p.add_argument("--report", help="where to write the JSON timing report")
    p.add_argument("--teleop", help="interventions: a teleop device type or YAML teleop section; the operator "
                   "takes over from the policy with the device's button (needs --dataset)")
    p.add_argument("--dataset", help="with --teleop: the dataset the episodes and interventions are recorded into")
    p.add_argument("--task", help="with --teleop: the instruction the episodes are recorded for")
    p.add_argument("--episodes", type=int, help="with --teleop: episodes to record")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_run)


def load_run_config(args: argparse.Namespace) -> RunConfig:
    data = load_yaml(args.config) if args.config else {}
    source = args.config or "<defaults>"
    if args.robot:
        data["robot"] = load_yaml(args.robot)
        source += f" + {args.robot}"
    flags = {k: getattr(args, k) for k in ("policy", "duration", "report") if getattr(args, k) is not None}
    if args.policy and Path(args.policy).is_dir():
        print("robopolicy run: a checkpoint directory given as --policy is deprecated, use --checkpoint", file=sys.stderr)
    if args.checkpoint:
        if args.policy:
            raise ConfigError("give --checkpoint DIR or a scripted --policy, not both")
        flags["policy"] = args.checkpoint
    data = deep_merge(data, flags)
    if args.overrides:
        data = deep_merge(data, parse_overrides(args.overrides))
        source += " + overrides"
    return build(RunConfig, data, source)


def cmd_intervene(args: argparse.Namespace) -> int:
    """``run --teleop``: the policy drives, the operator intervenes, a teleop session records."""
    import threading

    from robopolicy.commands.teleop import load_teleop_config
    from robopolicy.teleop.session import record_session

    if args.checkpoint and args.policy:
        raise ConfigError("give --checkpoint DIR or a scripted --policy, not both")
    if not (args.checkpoint or args.policy) or not args.dataset:
        raise ConfigError("--teleop records interventions over a policy: give --checkpoint DIR (or a scripted "
                          "--policy) and --dataset DIR")
    if args.report:
        raise ConfigError("--report is the timing report of a plain run; with --teleop the session reports itself")
    cfg = load_teleop_config(argparse.Namespace(**{**vars(args), "policy": args.checkpoint or args.policy}))
    stop = threading.Event()
    timer = threading.Timer(args.duration, stop.set) if args.duration else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        result = record_session(cfg, stop_event=stop)
    finally:
        if timer is not None:
            timer.cancel()
    print(f"run: {result.interventions} intervention(s), {result.intervention_frames} frames under intervention; "
          f"dataset: {cfg.dataset}")
    return 3 if result.fault else 0


def cmd_run(args: argparse.Namespace) -> int:
    if args.teleop:
        return cmd_intervene(args)
    for flag in ("dataset", "task", "episodes"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag} goes with --teleop (recording interventions)")
    cfg = load_run_config(args)
    report = run(cfg)
    t = report["timing"]
    late = t["lateness_us"]
    causes = ", ".join(f"{k} {v}" for k, v in t.get("miss_causes", {}).items())
    print(f"run: {t['ticks']} ticks at {report['rate_hz']:.0f} Hz, lateness p50 {late['p50']:.0f} us, "
          f"p99 {late['p99']:.0f} us, max {late['max']:.0f} us, missed deadlines {t['missed_deadlines']}"
          f"{f' ({causes})' if causes else ''}, skipped ticks {t['skipped_ticks']}; "
          f"faults: {[f['code'] for f in report['faults']] or 'none'}")
    if report.get("task"):
        print(f"task: {report['task']}")
    shutdown = report.get("shutdown") or {}
    if shutdown.get("signal"):
        print(f"stopped by {shutdown['signal']}: driver stopped {bool(shutdown.get('driver_stopped'))}, "
              f"disconnected {bool(shutdown.get('driver_disconnected'))}")
    print(f"timing report: {cfg.report}")
    return report["exit_code"]  # 128 + signal, 3 with a latched fault, else 0
