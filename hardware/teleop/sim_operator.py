"""SimOperator: a task's oracle behind a model of a person, for unattended interventions.

The person watches the policy drive and takes over when it heads for failure, late, noisily and
not always:

* **Rule for taking over.** At each step the operator compares the policy's proposed action
  with what the oracle would do. The policy *heads for failure* when the two differ by more
  than ``disagree`` (mean absolute difference in units of half the action range) on
  ``patience`` consecutive steps, or when the task's progress signal (``info["task_distance"]``,
  when the env gives one) has not fallen by ``min_progress`` over the last ``stall_steps`` steps.
  The operator then takes over.
* **Reaction delay.** A person acts late: the take-over starts ``delay`` seconds after the step
  that triggered it (the policy keeps driving meanwhile), ``delay`` drawn per take-over uniformly
  in ``reaction`` (150–300 ms by default).
* **Noise.** While driving, the operator's action is the oracle's plus Gaussian noise of
  ``noise`` × half the action range, clipped to the space; the clean oracle action is the label.
* **Lapses.** With rate ``lapse_rate`` per second the operator looks away for ``lapse_s``
  seconds and notices nothing (no take-over starts during a lapse).
* **Giving back.** After driving at least ``min_drive_s`` seconds, control goes back once the
  policy's proposals have agreed with the oracle (difference below ``disagree / 2``) for
  ``patience`` consecutive steps, or after ``max_drive_s``.

numpy only: usable by any sim loop (refinement, benchmarks) and by the hardware layer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np


@dataclass
class OperatorStep:
    """What the operator does at one step: ``action`` to execute, ``intervening`` (the operator
    drives), ``label`` (the oracle's clean action, the supervision), ``proposal`` (the policy's)."""

    action: np.ndarray
    intervening: bool
    label: np.ndarray
    proposal: np.ndarray


class SimOperator:
    def __init__(self, oracle: Any, dt: float, seed: int | None = None, action_space: Any = None, reaction: tuple[float, float] = (0.15, 0.30),
                 noise: float = 0.05, lapse_rate: float = 0.02, lapse_s: float = 2.0, disagree: float = 0.25,
                 patience: int = 3, min_progress: float = 0.0, stall_steps: int = 0, min_drive_s: float = 0.5,
                 max_drive_s: float = 5.0):
        if not 0 <= reaction[0] <= reaction[1]:
            raise ValueError(f"reaction must be (low, high) seconds with 0 <= low <= high, got {reaction}")
        self.oracle, self.dt = oracle, float(dt)
        self.rng = np.random.default_rng(seed)
        self.reaction, self.noise, self.lapse_rate, self.lapse_s = reaction, float(noise), float(lapse_rate), float(lapse_s)
        self.disagree, self.patience = float(disagree), int(patience)
        self.min_progress, self.stall_steps = float(min_progress), int(stall_steps)
        self.min_drive_s, self.max_drive_s = float(min_drive_s), float(max_drive_s)
        space = action_space if action_space is not None else oracle.action_space
        self.low, self.high = np.asarray(space.low, float), np.asarray(space.high, float)
        self.half = np.where(np.isfinite(self.high - self.low), 0.5 * (self.high - self.low), 1.0)
        self.takeovers = self.labels = self.lapses = 0
        self.reset_episode()

    def reset_episode(self) -> None:
        """A new episode: the operator starts watching, not driving."""
        self.driving = False
        self._bad = self._good = 0
        self._pending: int | None = None  # steps left until a decided take-over happens
        self._lapse_left = 0
        self._drive_steps = 0
        self._progress: deque[float] = deque(maxlen=max(1, self.stall_steps + 1))

    def reset(self, obs: Mapping[str, Any], info: Mapping[str, Any]) -> None:
        self.reset_episode()
        if self.oracle is not None:
            self.oracle.reset(obs, info)

    def _gap(self, a: np.ndarray, b: np.ndarray) -> float:
        return float(np.mean(np.abs((np.asarray(a, float) - np.asarray(b, float)) / self.half)))

    def _heads_for_failure(self, proposal: np.ndarray, label: np.ndarray, info: Mapping[str, Any]) -> bool:
        self._bad = self._bad + 1 if self._gap(proposal, label) > self.disagree else 0
        stalled = False
        if self.stall_steps > 0 and "task_distance" in info:
            self._progress.append(float(info["task_distance"]))
            if len(self._progress) == self._progress.maxlen:
                stalled = self._progress[0] - self._progress[-1] < self.min_progress
        return self._bad >= self.patience or stalled

    def step(self, obs: Mapping[str, Any], info: Mapping[str, Any], proposal: np.ndarray,
             label: np.ndarray | None = None) -> OperatorStep:
        """The operator's move at this step, given the policy's ``proposal``; ``label``: the
        oracle's action when the env already computed it (``oracle`` may then be None)."""
        label = np.asarray(self.oracle.label(obs, info).label if label is None else label, float)
        proposal = np.asarray(proposal, float)
        if self.driving:
            self._drive_steps += 1
            self._good = self._good + 1 if self._gap(proposal, label) < 0.5 * self.disagree else 0
            t = self._drive_steps * self.dt
            if t >= self.max_drive_s or (t >= self.min_drive_s and self._good >= self.patience):
                self.driving = False
                self._bad = 0
        else:
            if self._lapse_left > 0:
                self._lapse_left -= 1
            elif self.rng.random() < self.lapse_rate * self.dt:
                self._lapse_left = int(round(self.lapse_s / self.dt))
                self.lapses += 1
            if self._pending is not None:
                self._pending -= 1
                if self._pending <= 0:
                    self._pending = None
                    self.driving, self._drive_steps, self._good = True, 0, 0
                    self.takeovers += 1
            elif self._lapse_left == 0 and self._heads_for_failure(proposal, label, info):
                delay = self.rng.uniform(*self.reaction)
                self._pending = int(round(delay / self.dt))
                if self._pending <= 0:
                    self._pending = None
                    self.driving, self._drive_steps, self._good = True, 0, 0
                    self.takeovers += 1
        if not self.driving:
            return OperatorStep(proposal, False, label, proposal)
        self.labels += 1
        action = label + self.rng.normal(0.0, self.noise, label.shape) * self.half
        return OperatorStep(np.clip(action, self.low, self.high), True, label, proposal)
