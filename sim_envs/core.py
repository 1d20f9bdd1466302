"""Contracts shared by every task: oracles, action and option validation.

An oracle acts from the observation and the privileged ``info`` the env returns (never from
the env object), so it works the same inside a vector env, a recorder or a DAgger loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import gymnasium
import numpy as np


@dataclass
class OracleStep:
    """One oracle decision.

    action: what to execute, shape of the env's action space (noisy when noise > 0).
    label: the oracle's clean action, same shape; this is the imitation target.
    extras: further labels, e.g. ``{"waypoints": (K, 3) float32}`` for tracking.
    """

    action: np.ndarray
    label: np.ndarray
    extras: dict[str, np.ndarray] = field(default_factory=dict)


class Oracle:
    """Scripted expert with privileged state.

    DART-style noise: the executed action is the label plus Gaussian noise of standard
    deviation ``noise × noise_scale``, clipped to the action space; the label stays clean.
    ``noise_scale`` defaults to half the action range; a task whose range is much wider than
    the disturbance it tolerates (an arm's joint range vs a 2.5 cm cube) passes its own, so one
    ``noise`` setting (e.g. 0.1) means a comparable disturbance on every task.
    """

    replan: bool = False
    """Labelling states another policy drives (DAgger): re-anchor the plan to the robot's actual
    state before each label instead of following the oracle's own commanded path. An oracle that
    plans from the observed state alone ignores it."""

    def __init__(self, action_space: gymnasium.spaces.Box, noise: float = 0.0, seed: int | None = None,
                 noise_scale: np.ndarray | float | None = None):
        if not np.isfinite(noise) or noise < 0:
            raise ValueError(f"oracle noise must be a finite number >= 0, got {noise!r}")
        self.action_space = action_space
        self.noise = float(noise)
        if noise_scale is None:
            noise_scale = 0.5 * (action_space.high - action_space.low)
        self.noise_scale = np.broadcast_to(np.asarray(noise_scale, np.float64), action_space.shape)
        self.rng = np.random.default_rng(seed)

    def reset(self, obs: Mapping[str, Any], info: Mapping[str, Any]) -> None:
        """Start of an episode: read the static scene from ``info``."""

    def label(self, obs: Mapping[str, Any], info: Mapping[str, Any]) -> OracleStep:
        """Clean decision for the current state (``action == label``). Override this."""
        raise NotImplementedError

    def act(self, obs: Mapping[str, Any], info: Mapping[str, Any]) -> OracleStep:
        """Clean label plus, if ``noise > 0``, a disturbed action to execute."""
        step = self.label(obs, info)
        if self.noise > 0:
            low, high = self.action_space.low, self.action_space.high
            noisy = step.label + self.noise * self.noise_scale * self.rng.standard_normal(step.label.shape)
            step.action = np.clip(noisy, low, high).astype(self.action_space.dtype)
        return step


def make_oracle(env: gymnasium.Env, noise: float = 0.0, seed: int | None = None) -> Oracle:
    """The oracle of a robopolicy task (works through wrappers)."""
    base = env.unwrapped
    factory = getattr(base, "make_oracle", None)
    if factory is None:
        raise TypeError(f"{type(base).__name__} has no oracle; robopolicy tasks provide make_oracle()")
    return factory(noise=noise, seed=seed)


def check_action(action: Any, space: gymnasium.spaces.Box) -> np.ndarray:
    """Validate an action: right shape and finite; returns it as the space's dtype.

    Out-of-range values are clipped by the env (as a driver would); NaN/inf are an error.
    """
    arr = np.asarray(action, dtype=np.float64)
    if arr.shape != space.shape:
        raise ValueError(f"action must have shape {space.shape}, got {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"action contains non-finite values: {arr.tolist()}")
    return arr.astype(space.dtype)


def check_options(options: Mapping[str, Any] | None, allowed: Iterable[str]) -> dict[str, Any]:
    """Reject unknown reset options with an error that names them."""
    options = dict(options or {})
    allowed = set(allowed)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"unknown reset option(s) {unknown}; allowed: {sorted(allowed)}")
    return options


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """Validate a constructor argument against a fixed set of choices."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value
