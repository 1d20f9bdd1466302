"""One loader for every checkpoint directory, dispatching on the ``type`` its ``config.yaml`` names.

    policy = load_policy("outputs/refine/arm_pp")       # a Policy, a ModularPolicy or a residual
    checkpoint_type("outputs/train/arm/final")          # "policy"

Every policy class writes ``type`` into the ``config.yaml`` at the top of its checkpoint and
registers a loader for it here. A type's class is named by its import path and imported only
when a checkpoint of that type is loaded, so a caller (eval, deploy) imports no refinement code
until it meets a refined checkpoint. Checkpoints written before ``type`` existed are recognised
by their files: ``modular.yaml`` (perceive-then-act), ``residual.yaml`` (a residual or an
actor-critic), else ``config.yaml`` (a plain policy).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from robopolicy.config import load_yaml
from robopolicy.models.policy import CONFIG_FILE, PolicyError

# type -> "module:Class" whose ``load(directory, device)`` rebuilds the checkpoint
_LOADERS: dict[str, str] = {
    "policy": "robopolicy.models.policy:Policy",
    "modular": "robopolicy.models.modular:ModularPolicy",
    "residual": "robopolicy.refine.residual:ResidualPolicy",
    "planned": "robopolicy.world.plan:PlannedPolicy",  # a base's chunks refined by MPPI in a world model
}
# files that told a checkpoint's kind before ``type`` was written
_LEGACY_FILES = (("modular.yaml", "modular"), ("residual.yaml", "residual"))


def register_policy_type(name: str, target: str) -> None:
    """Load checkpoints whose ``config.yaml`` says ``type: name`` with ``target`` (``"module:Class"``,
    a class with ``load(directory, device)``)."""
    if ":" not in target:
        raise ValueError(f"policy type {name!r}: target {target!r} is not 'module:Class'")
    _LOADERS[name] = target


def policy_types() -> list[str]:
    """The checkpoint types :func:`load_policy` knows."""
    return sorted(_LOADERS)


def checkpoint_type(directory: str | Path) -> str:
    """The ``type`` of a checkpoint directory (read from its ``config.yaml``, or inferred from
    its files for a checkpoint saved before types were written)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PolicyError(f"{directory}: checkpoint directory not found")
    cfg_path = directory / CONFIG_FILE
    if cfg_path.is_file():
        kind = (load_yaml(cfg_path) or {}).get("type")
        if kind is not None:
            return str(kind)
    for name, kind in _LEGACY_FILES:
        if (directory / name).is_file():
            return kind
    if (directory / "residual.safetensors").is_file():
        raise PolicyError(f"{directory}: residual weights without their config")
    if not cfg_path.is_file():
        raise PolicyError(f"{directory}: not a checkpoint ({CONFIG_FILE} is missing)")
    return "policy"


def read_typed_config(directory: str | Path, kind: str, legacy_file: str) -> tuple[Path, dict]:
    """``(path, contents)`` of a ``kind`` checkpoint's config: ``config.yaml`` when it names
    ``type: kind``, else the ``legacy_file`` such a checkpoint had before types were written."""
    directory = Path(directory)
    path = directory / CONFIG_FILE
    meta = (load_yaml(path) or {}) if path.is_file() else {}
    if meta.get("type") == kind:
        return path, meta
    path = directory / legacy_file
    if not path.is_file():
        raise PolicyError(f"{directory}: not a {kind} checkpoint ({CONFIG_FILE} names no type: {kind})")
    return path, load_yaml(path) or {}


def policy_class(kind: str) -> type:
    """The class registered for checkpoint type ``kind`` (imported now)."""
    if kind not in _LOADERS:
        raise PolicyError(f"unknown checkpoint type {kind!r} (known: {', '.join(policy_types())})")
    module, _, attr = _LOADERS[kind].partition(":")
    return getattr(importlib.import_module(module), attr)


def load_policy(directory: str | Path, device: Any = "cpu") -> Any:
    """Rebuild any saved policy on ``device``; its class is chosen by the checkpoint's ``type``."""
    return policy_class(checkpoint_type(directory)).load(Path(directory), device)
