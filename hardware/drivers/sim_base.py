"""SimBaseDriver: the differential-drive robot of ``robopolicy/PersonFollow-v0`` in real time.

The env's robot and people are kinematic and advance in 0.1 s steps; this driver calls the
env's public ``step((v, omega))`` every env period on its own thread with the latest twist the
node wrote (the base's "motor controller" rate), and publishes the egocentric camera image and
the measured twist. When an episode ends its metrics are kept and a new one starts.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hardware.drivers.base import DriverError, DriverSpec
from hardware.drivers.sim_thread import RealtimeSimThread, SimSnapshot


class SimBaseDriver:
    """Real-time simulated base. Command and state: twist ``(v m/s, omega rad/s)``."""

    def __init__(
        self,
        env_id: str = "robopolicy/PersonFollow-v0",
        env_kwargs: dict[str, Any] | None = None,
        seed: int = 0,
        cameras: bool = True,
        image_size: int = 96,
        rate_hz: float = 50.0,
        max_acceleration: float = 3.0,
        command_timeout: float = 0.5,
        auto_reset: bool = True,
    ):
        self.env_id, self.env_kwargs, self.seed = env_id, dict(env_kwargs or {}), int(seed)
        self.use_cameras, self.image_size, self.auto_reset = bool(cameras), int(image_size), bool(auto_reset)
        v_max = float(self.env_kwargs.get("v_max", 1.2))
        w_max = float(self.env_kwargs.get("omega_max", 1.5))
        self.spec = DriverSpec(
            kind="base",
            names=("v", "omega"),
            command_low=(-v_max, -w_max),
            command_high=(v_max, w_max),
            max_rate=max_acceleration,
            command_timeout=command_timeout,
            rate_hz=rate_hz,
            cameras=("front",) if cameras else (),
        )
        self.env = None
        self.instruction = ""
        self.episodes: list[dict[str, Any]] = []
        self._sim: RealtimeSimThread | None = None

    def connect(self) -> None:
        import gymnasium

        import sim_envs  # noqa: F401  (registers the tasks)
        from sim_envs.person_follow import env as pf_env

        kwargs = dict(self.env_kwargs)
        kwargs.setdefault("image_size", self.image_size)
        self.env = gymnasium.make(self.env_id, camera=self.use_cameras, **kwargs)
        self._episode_seed = self.seed
        self._obs, self._last_info = None, {}
        self._finished = False
        self._sim = RealtimeSimThread("sim-base", pf_env.DT, self._step, setup=self._reset_episode,
                                      teardown=self._close_env, stale_after=1.0)
        self._sim.start()

    def _reset_episode(self) -> None:
        obs, info = self.env.reset(seed=self._episode_seed)
        self._episode_seed += 1
        self.instruction = str(obs.get("task", ""))
        self._obs, self._last_info = obs, info

    def _step(self, command: np.ndarray | None) -> SimSnapshot:
        if self._finished:  # episode over and no auto reset: the robot stands still
            return SimSnapshot(time.monotonic(), np.zeros(2), self._snapshot_images(), {"episode_done": True})
        twist = np.zeros(2, np.float32) if command is None else command.astype(np.float32)
        obs, _, terminated, truncated, info = self.env.step(twist)
        self._obs, self._last_info = obs, info
        keep = {k: info[k] for k in ("target_distance", "target_visible", "is_success") if k in info}
        if terminated or truncated:
            metrics = dict(info.get("episode_metrics", {}))
            metrics["instruction"] = self.instruction
            self.episodes.append(metrics)
            keep["episode_done"] = True
            if self.auto_reset:
                self._reset_episode()
            else:
                self._finished = True
        images = self._snapshot_images()
        state = np.asarray(obs["observation.state"], dtype=np.float64)
        return SimSnapshot(time.monotonic(), state, images, keep)

    def _snapshot_images(self) -> dict[str, np.ndarray]:
        if not self.use_cameras or self._obs is None:
            return {}
        return {"observation.images.front": self._obs["observation.images.front"]}

    def _close_env(self) -> None:
        if self.env is not None:  # its renderers belong to the simulation thread's GL context
            self.env.close()
            self.env = None

    def disconnect(self) -> None:
        if self._sim is not None:
            self._sim.close()
            self._sim = None

    def read(self) -> dict[str, Any]:
        if self._sim is None:
            raise DriverError("SimBaseDriver: not connected")
        snap = self._sim.latest()
        return {"observation.state": snap.state, **snap.images, "task": self.instruction}

    def write(self, command: np.ndarray) -> np.ndarray:
        if self._sim is None:
            raise DriverError("SimBaseDriver: not connected")
        sent = np.clip(np.asarray(command, dtype=np.float64), self.spec.command_low, self.spec.command_high)
        self._sim.set_command(sent)
        return sent

    def stop(self) -> None:
        if self._sim is not None:
            self._sim.set_command(np.zeros(2))

    def task_info(self) -> dict[str, Any]:
        """Last step's tracking info and finished episodes' metrics (evaluation only)."""
        snap = self._sim.latest() if self._sim is not None else None
        out = dict(snap.info) if snap is not None else {}
        out["episodes"] = list(self.episodes)
        return out
