"""SimArmDriver: the SO-101-like MuJoCo arm of ``sim_envs.arm``, stepped in real time.

The arm task env (``gymnasium.make("robopolicy/ArmReach-v0")`` etc.) builds the scene and samples
the task on reset; :class:`SimArmProgram` then steps that model's physics at its own timestep in
a process of its own (a servo loop with its own clock and CPU, see
:mod:`hardware.drivers.sim_process`), renders the task cameras at ``camera_fps``, and takes
absolute joint-position targets (5 arm joints + gripper angle, radians) like the env's
``action_mode="joint"``. The driver keeps its own copy of the env, reset with the same seed and
never stepped, for forward kinematics (:meth:`SimArmDriver.tool_position`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hardware.drivers.base import DriverError, DriverSpec
from hardware.drivers.sim_process import RealtimeSimProcess


class SimArmProgram:
    """The arm simulation, run in the simulation process (see :class:`~hardware.drivers.sim_process.SimProgram`).

    Info: ``task`` (the instruction) and, when the env can tell, ``is_success`` / ``task_distance``
    of the current state, refreshed with the images; with ``env_kwargs["env_state"]`` also
    ``environment_state``: the task's low-dimensional scene state (what a motion-capture system
    would report), at the camera rate.
    """

    def __init__(self, env_id: str, env_kwargs: dict[str, Any], seed: int, cameras: tuple[str, ...],
                 image_size: int, camera_fps: float):
        self.env_id, self.env_kwargs, self.seed = env_id, env_kwargs, seed
        self.cameras, self.image_size, self.camera_fps = tuple(cameras), image_size, camera_fps
        self.env = None
        self._renderer = None

    def setup(self) -> dict[str, Any]:
        import gymnasium
        import mujoco

        import sim_envs  # noqa: F401  (registers the tasks)
        import sim_envs.arm.so101 as so101

        self._so101 = so101
        self.env = gymnasium.make(self.env_id, use_cameras=False, **self.env_kwargs)
        obs, _ = self.env.reset(seed=self.seed)
        self.instruction = str(obs.get("task", ""))
        m = self.env.unwrapped.model
        self._model, self._data = m, self.env.unwrapped.data
        self._qadr = np.array([m.joint(j).qposadr[0] for j in so101.ARM_JOINTS])
        self._finger_qadr = np.array([m.joint(f"finger_{s}").qposadr[0] for s in ("left", "right")])
        self._arm_act = np.array([m.actuator(j).id for j in so101.ARM_JOINTS])
        self._finger_act = np.array([m.actuator(f"finger_{s}").id for s in ("left", "right")])
        if self.cameras:  # the GL context belongs to the process that creates it
            self._renderer = mujoco.Renderer(m, self.image_size, self.image_size)
        self._next_render = 0.0
        return {"task": self.instruction}

    def _state(self) -> np.ndarray:
        d, so101 = self._data, self._so101
        s = np.empty(6)
        s[:5] = d.qpos[self._qadr]
        s[5] = d.qpos[self._finger_qadr].mean() / so101.GRIP_M_PER_RAD
        return s

    def step(self, command: np.ndarray | None):
        import mujoco

        m, d = self._model, self._data
        if command is not None:
            d.ctrl[self._arm_act] = command[:5]
            d.ctrl[self._finger_act] = command[5] * self._so101.GRIP_M_PER_RAD
        mujoco.mj_step(m, d)
        images = info = None
        now = time.monotonic()
        if now >= self._next_render:
            self._next_render = now + 1.0 / self.camera_fps
            if self._renderer is not None:
                images = {}
                for cam in self.cameras:
                    self._renderer.update_scene(d, camera=cam)
                    images[f"observation.images.{cam}"] = self._renderer.render()
            info = {"task": self.instruction, **self._task_info()}
            if self.env_kwargs.get("env_state"):
                info["environment_state"] = self.env.unwrapped.environment_state().tolist()
        return self._state(), images, info

    def _task_info(self) -> dict[str, Any]:
        """Success of the env's task in the current state, when the env can tell."""
        evaluate = getattr(self.env.unwrapped, "_evaluate", None)
        if evaluate is None:
            return {}
        try:
            success, _, dist = evaluate()
        except Exception:
            return {}
        return {"is_success": bool(success), "task_distance": float(dist)}

    def teardown(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        if self.env is not None:
            self.env.close()
            self.env = None


class SimArmDriver:
    """Real-time simulated arm. Command and state: ``(6,)`` joint angles in radians."""

    def __init__(
        self,
        env_id: str = "robopolicy/ArmReach-v0",
        env_kwargs: dict[str, Any] | None = None,
        seed: int = 0,
        cameras: bool = True,
        image_size: int = 96,
        camera_fps: float = 20.0,
        rate_hz: float = 500.0,
        max_velocity: float = 3.0,
        max_acceleration: float = 30.0,
        command_timeout: float = 0.5,
    ):
        import sim_envs.arm.so101 as so101  # numpy constants only; the model is built on connect

        self.env_id, self.env_kwargs, self.seed = env_id, dict(env_kwargs or {}), int(seed)
        self.use_cameras, self.image_size, self.camera_fps = bool(cameras), int(image_size), float(camera_fps)
        self._so101 = so101
        self.spec = DriverSpec(
            kind="arm",
            names=tuple(so101.JOINT_NAMES),
            command_low=so101.JOINT_LOW,
            command_high=so101.JOINT_HIGH,
            max_rate=max_velocity,
            max_rate2=max_acceleration,
            command_timeout=command_timeout,
            rate_hz=rate_hz,
            cameras=("front", "wrist") if cameras else (),
        )
        self.env = None  # the driver's own copy, for forward kinematics only
        self.instruction = ""
        self._sim: RealtimeSimProcess | None = None
        self._fk_data = None
        self._last_state: np.ndarray | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def connect(self) -> None:
        import gymnasium
        import mujoco

        import sim_envs  # noqa: F401  (registers the tasks)

        so101 = self._so101
        self.env = gymnasium.make(self.env_id, use_cameras=False, **self.env_kwargs)
        self.env.reset(seed=self.seed)  # the same scene the simulation process samples
        m = self.env.unwrapped.model
        self._model = m
        self._qadr = np.array([m.joint(j).qposadr[0] for j in so101.ARM_JOINTS])
        self._tcp = m.site("tcp").id
        self._fk_data = mujoco.MjData(m)
        size = self.image_size
        self._sim = RealtimeSimProcess(
            "sim-arm", float(m.opt.timestep), SimArmProgram,
            dict(env_id=self.env_id, env_kwargs=self.env_kwargs, seed=self.seed, cameras=self.spec.cameras,
                 image_size=size, camera_fps=self.camera_fps),
            state_dim=6, command_dim=6, cameras={f"observation.images.{c}": (size, size, 3) for c in self.spec.cameras},
        )
        try:
            self._sim.start()
            snap = self._sim.latest()
        except BaseException:
            self.disconnect()
            raise
        self.instruction = str(snap.info.get("task", ""))
        self._last_state = snap.state

    def disconnect(self) -> None:
        if self._sim is not None:
            self._sim.close()
            self._sim = None
        if self.env is not None:
            self.env.close()
            self.env = None

    # -- per tick ---------------------------------------------------------------------------
    def read(self) -> dict[str, Any]:
        if self._sim is None:
            raise DriverError("SimArmDriver: not connected")
        snap = self._sim.latest()
        self._last_state = snap.state
        obs: dict[str, Any] = {"observation.state": snap.state, **snap.images}
        if "environment_state" in snap.info:  # env_kwargs env_state=true: a state-based policy reads it
            obs["observation.environment_state"] = np.asarray(snap.info["environment_state"], np.float32)
        obs["task"] = self.instruction
        return obs

    def write(self, command: np.ndarray) -> np.ndarray:
        if self._sim is None:
            raise DriverError("SimArmDriver: not connected")
        sent = np.clip(np.asarray(command, dtype=np.float64), self.spec.command_low, self.spec.command_high)
        self._sim.set_command(sent)
        return sent

    def stop(self) -> None:
        if self._sim is None:
            return
        try:
            hold = self._sim.latest().state
        except DriverError:  # the simulation died or stalled: hold the last state it reported
            hold = self._last_state
        self._sim.set_command(hold)

    # -- extras -----------------------------------------------------------------------------
    def task_info(self) -> dict[str, Any]:
        """Task success / distance (privileged; for evaluation only, never sent to the policy)."""
        snap = self._sim.latest() if self._sim is not None else None
        return {k: v for k, v in snap.info.items() if k != "task"} if snap is not None else {}

    def tool_position(self, command: np.ndarray) -> np.ndarray:
        """Forward kinematics: tool-centre point (x, y, z) of a joint command (for the workspace box)."""
        import mujoco

        fd = self._fk_data
        fd.qpos[self._qadr] = command[:5]
        mujoco.mj_kinematics(self._model, fd)
        return fd.site_xpos[self._tcp].copy()
