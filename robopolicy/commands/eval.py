"""``robopolicy eval``: roll a checkpoint out in simulation; per-split metrics, JSON, table, videos.

    robopolicy eval --checkpoint outputs/train/pf_staged --env robopolicy/PersonFollow-v0 --episodes 200 --workers 2
    robopolicy eval --checkpoint outputs/train/arm_act --env robopolicy/ArmPickPlace-v0 --episodes 50 \\
        chunk.mode=ensemble chunk.ensemble_coeff=0.01
    robopolicy eval --checkpoint CKPT --config configs/eval/pusher.yaml  # any gymnasium env + mapping
    robopolicy eval --checkpoint CKPT --env my_pkg.envs:MyEnv-v0 --episodes=10  # module:EnvId imports my_pkg.envs
    robopolicy eval --checkpoint CKPT --env robopolicy/PersonFollow-v0 --split dt --instruction swap  # or blank
    robopolicy eval --checkpoint oracle --env robopolicy/PersonFollow-v0 --episodes 200  # the task's oracle

Results go to ``--out``, by default ``outputs/eval/<name>``, a name derived from the checkpoint
path (:func:`default_out`), so evaluations of different checkpoints never overwrite each other.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path
from typing import Any

from robopolicy.config import ConfigError, load_config, load_yaml, parse_overrides
from robopolicy.eval.config import EvalConfig
from robopolicy.eval.oracle_policy import ORACLE_CHECKPOINT, OraclePolicy


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint in simulation (vectorized, per-split metrics, videos)")
    p.add_argument("--checkpoint", help="policy checkpoint directory (plain, modular or refined), or 'oracle': "
                   "the task's privileged oracle acts")
    p.add_argument("--env", help="env id: a registered one (robopolicy/PersonFollow-v0, Pusher-v5) or "
                   "module:EnvId, whose module is imported to register it (default: the checkpoint's)")
    p.add_argument("--split", action="append", help="PersonFollow split (repeatable; default: all three)")
    p.add_argument("--episodes", type=int, help="episodes per split (seeds seed..seed+N-1)")
    p.add_argument("--workers", type=int, help="parallel envs (worker processes when > 1)")
    p.add_argument("--seed", type=int, help="first episode seed")
    p.add_argument("--videos", type=int, help="MP4s of the first N episodes per split")
    p.add_argument("--instruction", choices=["normal", "swap", "blank"],
                   help="normal; swap: the instruction names another visible person, the new target "
                   "(PersonFollow); blank: an empty instruction")
    p.add_argument("--out", help="output directory (default: outputs/eval/<name derived from the checkpoint path>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--config", help="YAML config (EvalConfig), e.g. configs/eval/pusher.yaml: gymnasium's Pusher-v5 "
                   "with the mapping of its observation to the policy's keys")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_eval)


def _overrides(args: argparse.Namespace) -> list[str]:
    out = []
    for flag, key in (("checkpoint", "checkpoint"), ("env", "env.id"), ("episodes", "episodes"),
                      ("workers", "workers"), ("seed", "seed"), ("videos", "videos"),
                      ("out", "out"), ("instruction", "instruction")):
        value = getattr(args, flag)
        if value is not None:
            out.append(f"{key}={value}")
    if args.split:
        out.append(f"splits=[{','.join(args.split)}]")
    if args.no_progress:
        out.append("progress=false")
    return out + list(args.overrides)


def load_policy(checkpoint: str | Path, device: str = "auto") -> Any:
    """A checkpoint directory (plain or refined) on ``device`` (``auto``: CUDA when available), in eval mode."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise ConfigError(f"checkpoint {str(path)!r} is not a directory (give the folder Policy.save wrote)")
    import torch

    from robopolicy.models.loading import load_policy as load_checkpoint

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = load_checkpoint(path, device=device)  # a Policy, or a refined base + residual
    policy.eval()
    return policy


def checkpoint_env(checkpoint: str | Path) -> dict[str, Any] | None:
    """The task a checkpoint was trained on, when its run says so: the run's ``train_config.yaml``
    names the dataset, whose ``meta/info.json`` names the task (``robot_type``)."""
    import json

    import gymnasium

    path = Path(checkpoint)
    for run in (path, path.parent, path.parent.parent):
        cfg_file = run / "train_config.yaml"
        if not cfg_file.is_file():
            continue
        dataset = (load_yaml(cfg_file).get("data") or {}).get("dataset")
        info = Path(str(dataset)) / "meta" / "info.json"
        if not dataset or not info.is_file():
            return None
        robot_type = json.loads(info.read_text()).get("robot_type") or ""
        for env_id in (robot_type, f"robopolicy/{robot_type}"):
            if env_id in gymnasium.registry:
                return {"id": env_id, "kwargs": {}}
        return None
    return None


GENERIC_NAMES = re.compile(r"final|best|last|latest|checkpoint|checkpoints|step_\d+|model")
"""Checkpoint directory names that say which snapshot, not which run (``final``, ``step_000500``)."""


def default_out(checkpoint: str | Path) -> Path:
    """``outputs/eval/<name>``, unique per checkpoint: the checkpoint's directory name, prefixed
    with its run's where the name is generic (``arm_pp-final``), and a short digest of its full
    path (two runs named alike in different folders still get two directories)."""
    path = Path(checkpoint)
    parts = [p for p in path.parts if p not in ("/", ".", "..")] or ["checkpoint"]
    name = [parts[-1]]
    for parent in reversed(parts[:-1]):
        if not GENERIC_NAMES.fullmatch(name[0]):
            break
        name.insert(0, parent)
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:6]
    return Path("outputs/eval") / f"{'-'.join(name)}-{digest}"


def _out_given(args: argparse.Namespace) -> bool:
    """Whether the user chose the output directory (flag, config file or override, old key included)."""
    keys = ("out", "out_dir")
    file_keys = load_yaml(args.config) if args.config else {}
    return args.out is not None or any(k in parse_overrides(args.overrides) or k in file_keys for k in keys)


def _env_given(args: argparse.Namespace) -> bool:
    """Whether the user chose the env id (flag, config file or override)."""
    if args.env:
        return True
    if args.config and "id" in (load_yaml(args.config).get("env") or {}):
        return True
    return "id" in (parse_overrides(args.overrides).get("env") or {})


def cmd_eval(args: argparse.Namespace) -> int:
    from robopolicy.eval.rollout import evaluate

    cfg = load_config(EvalConfig, args.config, _overrides(args))
    if not cfg.checkpoint:
        raise ConfigError("no checkpoint: give --checkpoint DIR (or checkpoint: in the config)")
    if not _out_given(args):
        cfg.out = str(default_out(cfg.checkpoint))
    out = cfg.out
    env_given = _env_given(args)
    if env_given:
        from robopolicy.envs import resolve_env_id

        resolve_env_id(cfg.env.id)  # a bad env id fails now, not after the checkpoint has loaded
    if cfg.checkpoint == ORACLE_CHECKPOINT:
        if not env_given:
            raise ConfigError("--checkpoint oracle needs the env: give --env ID (or env.id in the --config file)")
        policy = OraclePolicy.for_env(cfg.env)
    else:
        try:
            policy = load_policy(cfg.checkpoint, cfg.device)
        except (FileNotFoundError, ValueError, KeyError) as exc:
            print(f"robopolicy eval: cannot load checkpoint {cfg.checkpoint}: {exc}", file=sys.stderr)
            return 1
    if not env_given:
        env = checkpoint_env(cfg.checkpoint)
        if env is None:
            raise ConfigError(f"no env to evaluate {cfg.checkpoint} in: its training run records none; give --env ID "
                              f"(a registered id such as robopolicy/ArmPickPlace-v0, or module:EnvId) or env.id in "
                              f"the --config file")
        cfg.env.id = env["id"]
        cfg.env.kwargs = {**env.get("kwargs", {}), **cfg.env.kwargs}
    report = evaluate(policy, cfg)
    print()
    print(report.table())
    print(f"\nresults: {out}/eval.json, {out}/eval.md; videos: {out}/videos/")
    return 0
