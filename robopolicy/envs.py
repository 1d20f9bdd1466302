"""Env configs shared by every command that builds a task (sim, collect, eval, refine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gymnasium

import sim_envs  # noqa: F401  (registers the robopolicy/ tasks)
from robopolicy.config import ConfigError


@dataclass
class EnvConfig:
    """Which task to build and its constructor kwargs (e.g. ``{split: dt, image_size: 96}``)."""

    id: str = "robopolicy/PersonFollow-v0"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        split = self.kwargs.get("split")
        name = self.id.split("/")[-1]
        return f"{name}[{split}]" if split else name


def make_env(cfg: EnvConfig, render_mode: str | None = "rgb_array") -> gymnasium.Env:
    """Build the env; an unknown id or a bad kwarg becomes a ConfigError naming it."""
    if cfg.id not in gymnasium.registry:
        known = ", ".join(sorted(k for k in gymnasium.registry if k.startswith("robopolicy/")))
        raise ConfigError(f"unknown env id {cfg.id!r} (robopolicy tasks: {known})")
    try:
        return gymnasium.make(cfg.id, render_mode=render_mode, disable_env_checker=True, **cfg.kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"env {cfg.id} kwargs {cfg.kwargs}: {exc}") from None
