"""SimBaseDriver: the differential-drive robot of ``robopolicy/PersonFollow-v0`` in real time.

The env's robot and people are kinematic and advance in 0.1 s steps; :class:`SimBaseProgram`
calls the env's public ``step((v, omega))`` every env period in a process of its own (the base's
"motor controller", with its own clock and CPU, see :mod:`hardware.drivers.sim_process`) with
the latest twist the node wrote, and publishes the egocentric camera image and the measured
twist. When an episode ends its metrics are kept and a new one (with a new instruction) starts.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np

from hardware.drivers.base import DriverError, DriverSpec
from hardware.drivers.sim_process import RealtimeSimProcess

RECENT_EPISODES = 32  # finished episodes' metrics carried in the info; the driver reads it every tick
_PROGRAM_KEYS = ("task", "episodes_done", "recent_episodes")  # info keys for the driver, not for task_info()


class SimBaseProgram:
    """The base simulation, run in the simulation process (see :class:`~hardware.drivers.sim_process.SimProgram`).

    Info: the last step's tracking info (``target_distance``, ``target_visible``, ``is_success``;
    ``episode_done`` on the step that ended an episode), plus ``task`` (the current episode's
    instruction), ``episodes_done`` and the metrics of the last :data:`RECENT_EPISODES` finished
    episodes (``recent_episodes``).
    """

    def __init__(self, env_id: str, env_kwargs: dict[str, Any], seed: int, cameras: bool, auto_reset: bool):
        self.env_id, self.env_kwargs, self.seed = env_id, env_kwargs, seed
        self.cameras, self.auto_reset = cameras, auto_reset
        self.env = None

    def setup(self) -> dict[str, Any]:
        import gymnasium

        import sim_envs  # noqa: F401  (registers the tasks)

        self.env = gymnasium.make(self.env_id, camera=self.cameras, **self.env_kwargs)
        self._episode_seed = self.seed
        self._finished = False
        self._episodes_done = 0
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_EPISODES)
        self._reset_episode()
        return self._info({})

    def _reset_episode(self) -> None:
        obs, _ = self.env.reset(seed=self._episode_seed)
        self._episode_seed += 1
        self.instruction = str(obs.get("task", ""))
        self._obs = obs

    def _info(self, keep: dict[str, Any]) -> dict[str, Any]:
        return {**keep, "task": self.instruction, "episodes_done": self._episodes_done,
                "recent_episodes": list(self._recent)}

    def step(self, command: np.ndarray | None):
        if self._finished:  # episode over and no auto reset: the robot stands still
            return np.zeros(2), None, self._info({"episode_done": True})
        twist = np.zeros(2, np.float32) if command is None else command.astype(np.float32)
        obs, _, terminated, truncated, info = self.env.step(twist)
        self._obs = obs
        keep = {k: info[k] for k in ("target_distance", "target_visible", "is_success") if k in info}
        if terminated or truncated:
            metrics = dict(info.get("episode_metrics", {}))
            metrics["instruction"] = self.instruction
            self._episodes_done += 1
            self._recent.append(metrics)
            keep["episode_done"] = True
            if self.auto_reset:
                self._reset_episode()
            else:
                self._finished = True
        images = {"observation.images.front": self._obs["observation.images.front"]} if self.cameras else None
        state = np.asarray(obs["observation.state"], dtype=np.float64)
        return state, images, self._info(keep)

    def teardown(self) -> None:
        if self.env is not None:  # its renderers belong to this process's GL context
            self.env.close()
            self.env = None


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
        self.instruction = ""
        self.episodes: list[dict[str, Any]] = []
        self._sim: RealtimeSimProcess | None = None
        self._sync_lock = threading.Lock()
        self._synced_info: dict[str, Any] | None = None
        self._episodes_seen = 0

    def connect(self) -> None:
        import gymnasium

        import sim_envs  # noqa: F401  (registers the tasks)
        from sim_envs.person_follow import env as pf_env

        kwargs = dict(self.env_kwargs)
        kwargs.setdefault("image_size", self.image_size)
        cameras = {}
        if self.use_cameras:  # the image shape, from an env that is built but never reset or rendered
            env = gymnasium.make(self.env_id, camera=True, **kwargs)
            cameras["observation.images.front"] = env.observation_space["observation.images.front"].shape
            env.close()
        self._sim = RealtimeSimProcess(
            "sim-base", pf_env.DT, SimBaseProgram,
            dict(env_id=self.env_id, env_kwargs=kwargs, seed=self.seed, cameras=self.use_cameras,
                 auto_reset=self.auto_reset),
            state_dim=2, command_dim=2, cameras=cameras, stale_after=1.0,
        )
        try:
            self._sim.start()
            self._sync(self._sim.latest().info)
        except BaseException:
            self.disconnect()
            raise

    def _sync(self, info: dict[str, Any]) -> None:
        """Take the instruction and newly finished episodes from a snapshot's info."""
        with self._sync_lock:  # the control loop reads while task_info() may be called elsewhere
            if info is self._synced_info:
                return
            self._synced_info = info
            self.instruction = str(info.get("task", ""))
            done = int(info.get("episodes_done", 0))
            if done > self._episodes_seen:
                self.episodes.extend(info.get("recent_episodes", [])[-(done - self._episodes_seen):])
                self._episodes_seen = done

    def disconnect(self) -> None:
        if self._sim is not None:
            self._sim.close()
            self._sim = None

    def read(self) -> dict[str, Any]:
        if self._sim is None:
            raise DriverError("SimBaseDriver: not connected")
        snap = self._sim.latest()
        self._sync(snap.info)
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
        out = {}
        if snap is not None:
            self._sync(snap.info)
            out = {k: v for k, v in snap.info.items() if k not in _PROGRAM_KEYS}
        out["episodes"] = list(self.episodes)
        return out
