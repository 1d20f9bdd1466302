"""``robopolicy diagnose <what>``: how a policy's episodes end, beyond a success rate.

    robopolicy diagnose pickplace-failures --checkpoint outputs/train/arm_state_75/final --episodes 100
    robopolicy diagnose pickplace-failures --checkpoint CKPT release=step correct=center,carry
    robopolicy diagnose tracking-failures --checkpoint outputs/train/track_stage3/final --split dt
    robopolicy diagnose encoder-probe --episodes 200

Each diagnosis prints a markdown table and its findings, ends with a one-line summary, and with
``--out DIR`` also writes ``DIR/<what>.json`` (the counts and measurements) and the run record
``DIR/summary.json`` (share of each episode end as metrics). Settings beyond the
flags are ``key=value`` overrides of its config (:mod:`robopolicy.diagnose.pickplace_failures`,
:mod:`robopolicy.diagnose.tracking_failures`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DIAGNOSES = {
    "pickplace-failures": ("robopolicy.diagnose.pickplace_failures", "PickPlaceFailuresConfig",
                           "how an ArmPickPlace policy's episodes end (never lifted, held, dropped), "
                           "with scripted release / corrections as anchors"),
    "tracking-failures": ("robopolicy.diagnose.tracking_failures", "TrackingFailuresConfig",
                          "how a PersonFollow policy's episodes end (lost, collisions by kind) and whether "
                          "the oracle could still have saved them"),
    "encoder-probe": ("robopolicy.diagnose.encoder_probe", "EncoderProbeConfig",
                      "linear probe of frozen encoder features on sim frames (shirt colour, person or "
                      "background, cube colour): "
                      "pretrained weights against a random init"),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="break down how a policy's episodes end (pickplace-failures, tracking-failures); "
                       "probe an encoder's frozen features (encoder-probe)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_subparsers(dest="what", metavar="WHAT")
    what.required = True
    for name, (_module, _cls, help_text) in DIAGNOSES.items():
        q = what.add_parser(name, help=help_text)
        if name != "encoder-probe":  # the probe reads frames and an encoder, no policy
            q.add_argument("--checkpoint", help="policy checkpoint directory")
        q.add_argument("--episodes", type=int, help="episodes (seeds seed..seed+N-1)")
        q.add_argument("--seed", type=int, help="first episode seed (default: " +
                       ("0" if name == "encoder-probe" else "the evaluation seeds") + ")")
        if name == "tracking-failures":
            q.add_argument("--split", help="PersonFollow split: stt, dt or at")
        q.add_argument("--out", help="also write <out>/" + name + ".json")
        q.add_argument("--no-progress", action="store_true", help="no progress bar")
        q.add_argument("overrides", nargs="*", metavar="key=value")
        q.set_defaults(func=cmd_diagnose)


def cmd_diagnose(args: argparse.Namespace) -> int:
    import importlib

    from robopolicy.config import load_config

    module_name, cls_name, _help = DIAGNOSES[args.what]
    module = importlib.import_module(module_name)
    flags = [f"{key}={getattr(args, key)}" for key in ("checkpoint", "episodes", "seed", "split")
             if getattr(args, key, None) is not None]
    cfg = load_config(getattr(module, cls_name), None, flags + list(args.overrides or []))
    started = time.time()
    result = module.diagnose(cfg, progress=not args.no_progress)
    lines = module.report(result)
    if args.out:
        from robopolicy.utils.files import atomic_write_text
        from robopolicy.utils.records import write_summary

        out = Path(args.out) / f"{args.what}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(result, indent=2, default=float))
        n = result["episodes"]
        if hasattr(module, "metrics"):
            metrics = module.metrics(result)
        else:
            shares = {kind: count / n for kind, count in result["counts"].items()}
            metrics = {"success_rate": shares["success"], "ends": shares}
        write_summary(args.out, kind="diagnose", config=cfg, seeds=[cfg.seed], episodes=n, started_at=started,
                      metrics=metrics, extra={"diagnosis": args.what})
        lines.insert(-1, f"written: {out} and {Path(args.out) / 'summary.json'}")
    print("\n".join(lines))
    return 0
