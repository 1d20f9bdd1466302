"""PointReach: a task with a known answer, for checking that a learning loop learns.

A point in the unit square moves by ``0.1 * action`` per step (action in [-1, 1]²) toward a goal
drawn at reset; the episode ends with success when the point is within ``tolerance`` of the
goal, or fails after ``max_steps``. The optimal policy is known (move straight at the goal, full
speed until the last step) and reaches any goal within ~15 steps, so PPO from scratch, a chunk
actor or an imitation loop should get close to 100% within a few thousand episodes; when they do
not, the loop has a defect, not the task. No physics, no rendering: thousands of steps per
second on one core.

Observation: ``observation.state (4,)`` = point (x, y), goal (x, y). Info: ``is_success``, and
``episode_metrics`` on the last step (success, steps, return, final_distance). Reward: the
decrease in distance to the goal (dense), +1 on success.
"""

from __future__ import annotations

import gymnasium
import numpy as np
from gymnasium import spaces

from sim_envs.core import Oracle, OracleStep, check_action


class PointReachEnv(gymnasium.Env):
    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, max_steps: int = 50, tolerance: float = 0.05, render_mode: str | None = None,
                 render_size: int = 96):
        if max_steps < 1 or not (0 < tolerance < 1):
            raise ValueError(f"PointReach: max_steps must be >= 1 and 0 < tolerance < 1 (got {max_steps}, {tolerance})")
        self.max_steps, self.tolerance = int(max_steps), float(tolerance)
        self.render_mode, self.render_size = render_mode, int(render_size)
        self.observation_space = spaces.Dict({"observation.state": spaces.Box(0.0, 1.0, (4,), np.float32)})
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.env_state_dim = 2
        self._pos = np.zeros(2)
        self._goal = np.zeros(2)
        self._t, self._ret = 0, 0.0

    def _obs(self) -> dict:
        return {"observation.state": np.concatenate([self._pos, self._goal]).astype(np.float32)}

    def environment_state(self) -> np.ndarray:
        """Goal minus point ``(2,)`` (the privileged view refinement inputs may use)."""
        return (self._goal - self._pos).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._pos = self.np_random.uniform(0.1, 0.9, 2)
        self._goal = self.np_random.uniform(0.1, 0.9, 2)
        while np.linalg.norm(self._goal - self._pos) < 3 * self.tolerance:
            self._goal = self.np_random.uniform(0.1, 0.9, 2)
        self._t, self._ret = 0, 0.0
        return self._obs(), {"is_success": False}

    def step(self, action):
        a = np.clip(check_action(action, self.action_space), -1.0, 1.0).astype(np.float64)
        before = float(np.linalg.norm(self._goal - self._pos))
        self._pos = np.clip(self._pos + 0.1 * a, 0.0, 1.0)
        self._t += 1
        dist = float(np.linalg.norm(self._goal - self._pos))
        success = dist < self.tolerance
        reward = before - dist + (1.0 if success else 0.0)
        self._ret += reward
        terminated, truncated = success, (not success) and self._t >= self.max_steps
        info = {"is_success": bool(success)}
        if terminated or truncated:
            info["episode_metrics"] = {"success": float(success), "steps": float(self._t), "return": self._ret,
                                       "final_distance": dist}
        return self._obs(), float(reward), bool(terminated), bool(truncated), info

    def render(self) -> np.ndarray:
        """Top view ``(S, S, 3)`` uint8: the goal's tolerance disc green, the point red."""
        s = self.render_size
        yy, xx = (np.mgrid[0:s, 0:s] + 0.5) / s
        img = np.full((s, s, 3), 235, np.uint8)
        img[(xx - self._goal[0]) ** 2 + (yy - self._goal[1]) ** 2 < self.tolerance**2] = (40, 170, 60)
        img[(xx - self._pos[0]) ** 2 + (yy - self._pos[1]) ** 2 < (1.5 / s + 0.01) ** 2] = (200, 40, 40)
        return img[::-1]

    def make_oracle(self, noise: float = 0.0, seed: int | None = None) -> Oracle:
        return PointReachOracle(self.action_space, noise=noise, seed=seed)


class PointReachOracle(Oracle):
    """Straight at the goal: full speed, the last step exactly onto it."""

    def label(self, obs, info) -> OracleStep:
        s = np.asarray(obs["observation.state"], np.float64)
        a = np.clip((s[2:] - s[:2]) / 0.1, -1.0, 1.0).astype(np.float32)
        return OracleStep(action=a, label=a.copy())
