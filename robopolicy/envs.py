"""Env configs shared by every command that builds a task (sim, collect, eval, refine).

An env id is any gymnasium id: a registered one (``robopolicy/PersonFollow-v0``,
``Pusher-v5``) or ``module:EnvId``, whose module is imported first so that it registers its
envs (``my_sim.envs:Cube-v0``), as ``gymnasium.make`` does.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import gymnasium

import sim_envs  # noqa: F401  (registers the robopolicy/ tasks)
from robopolicy.config import ConfigError


@dataclass
class EnvConfig:
    """Which task to build and its constructor kwargs (e.g. ``{split: dt, image_size: 96}``)."""

    id: str = "robopolicy/PersonFollow-v0"
    """A registered gymnasium id, or ``module:EnvId`` (the module is imported to register it)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    randomize: dict[str, Any] = field(default_factory=dict)
    """Domain randomisation at every reset (:mod:`sim_envs.randomization`): ``{lighting, textures,
    camera_jitter: true/false, distractors: N, seed: S}``; empty: off."""

    def label(self) -> str:
        split = self.kwargs.get("split")
        name = registered_id(self.id).split("/")[-1]
        return f"{name}[{split}]" if split else name


def split_env_id(env_id: str) -> tuple[str | None, str]:
    """``"module:EnvId"`` → ``("module", "EnvId")``; a plain id → ``(None, id)``."""
    module, sep, name = env_id.rpartition(":")
    return (module, name) if sep else (None, env_id)


def registered_id(env_id: str) -> str:
    """The gymnasium id of ``env_id`` without its module prefix (nothing is imported)."""
    return split_env_id(env_id)[1]


def resolve_env_id(env_id: str) -> str:
    """Import the module of a ``module:EnvId`` id and return the registered ``EnvId``; a plain id
    must be registered already. Either failure is a ConfigError naming the fix."""
    module, name = split_env_id(env_id)
    if module:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"env id {env_id!r}: cannot import module {module!r} ({exc})") from None
    if name not in gymnasium.registry:
        known = ", ".join(sorted(k for k in gymnasium.registry if k.startswith("robopolicy/")))
        where = (f"module {module!r} did not register it" if module else
                 "if a module registers it, give the id as 'module:EnvId' (e.g. my_pkg.envs:MyEnv-v0)")
        raise ConfigError(f"unknown env id {env_id!r}: {where} (robopolicy tasks: {known})")
    return name


def make_env(cfg: EnvConfig, render_mode: str | None = "rgb_array") -> gymnasium.Env:
    """Build the env; an unknown id or a bad kwarg becomes a ConfigError naming it."""
    env_id = resolve_env_id(cfg.id)
    try:
        env = gymnasium.make(env_id, render_mode=render_mode, disable_env_checker=True, **cfg.kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"env {cfg.id} kwargs {cfg.kwargs}: {exc}") from None
    if cfg.randomize:
        from sim_envs.randomization import DomainRandomization

        try:
            env = DomainRandomization(env, cfg.randomize)
        except ValueError as exc:
            raise ConfigError(f"env {cfg.id}: {exc}") from None
    return env
