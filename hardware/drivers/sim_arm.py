"""SimArmDriver: the SO-101-like MuJoCo arm of ``sim_envs.arm``, stepped in real time.

The arm task env (``gymnasium.make("robopolicy/ArmReach-v0")`` etc.) builds the scene and samples
the task on reset; this driver then steps that model's physics at its own timestep on a thread
of its own (a servo loop with its own clock), renders the task cameras at ``camera_fps``, and
takes absolute joint-position targets (5 arm joints + gripper angle, radians) like the env's
``action_mode="joint"``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hardware.drivers.base import DriverError, DriverSpec
from hardware.drivers.sim_thread import RealtimeSimThread, SimSnapshot


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
        self.env = None
        self.instruction = ""
        self._sim: RealtimeSimThread | None = None
        self._fk_data = None

    # -- lifecycle --------------------------------------------------------------------------
    def connect(self) -> None:
        import gymnasium
        import mujoco

        import sim_envs  # noqa: F401  (registers the tasks)

        so101 = self._so101
        self.env = gymnasium.make(self.env_id, use_cameras=False, **self.env_kwargs)
        obs, _ = self.env.reset(seed=self.seed)
        self.instruction = str(obs.get("task", ""))
        base = self.env.unwrapped
        m, d = base.model, base.data
        self._model, self._data = m, d
        self._qadr = np.array([m.joint(j).qposadr[0] for j in so101.ARM_JOINTS])
        self._finger_qadr = np.array([m.joint(f"finger_{s}").qposadr[0] for s in ("left", "right")])
        self._arm_act = np.array([m.actuator(j).id for j in so101.ARM_JOINTS])
        self._finger_act = np.array([m.actuator(f"finger_{s}").id for s in ("left", "right")])
        self._tcp = m.site("tcp").id
        self._fk_data = mujoco.MjData(m)
        self._renderer = None
        self._next_render = 0.0
        self._images: dict[str, np.ndarray] = {}
        self._info: dict[str, Any] = {}
        self._sim = RealtimeSimThread(
            "sim-arm", float(m.opt.timestep), self._step, setup=self._setup, teardown=self._teardown
        )
        self._sim.start()

    def _setup(self) -> None:
        if self.use_cameras:  # the GL context belongs to the thread that creates it
            import mujoco

            self._renderer = mujoco.Renderer(self._model, self.image_size, self.image_size)

    def _teardown(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None

    def _state(self) -> np.ndarray:
        d, so101 = self._data, self._so101
        s = np.empty(6)
        s[:5] = d.qpos[self._qadr]
        s[5] = d.qpos[self._finger_qadr].mean() / so101.GRIP_M_PER_RAD
        return s

    def _step(self, command: np.ndarray | None) -> SimSnapshot:
        import mujoco

        m, d = self._model, self._data
        if command is not None:
            d.ctrl[self._arm_act] = command[:5]
            d.ctrl[self._finger_act] = command[5] * self._so101.GRIP_M_PER_RAD
        mujoco.mj_step(m, d)
        now = time.monotonic()
        if now >= self._next_render:
            self._next_render = now + 1.0 / self.camera_fps
            if self._renderer is not None:
                images = {}
                for cam in self.spec.cameras:
                    self._renderer.update_scene(d, camera=cam)
                    images[f"observation.images.{cam}"] = self._renderer.render().copy()
                self._images = images
            self._info = self._task_info()
        return SimSnapshot(now, self._state(), self._images, self._info)

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
        obs: dict[str, Any] = {"observation.state": snap.state, **snap.images}
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
            hold = self._sim.latest().state.copy()
        except DriverError:
            hold = self._state()
        self._sim.set_command(hold)

    # -- extras -----------------------------------------------------------------------------
    def task_info(self) -> dict[str, Any]:
        """Task success / distance (privileged; for evaluation only, never sent to the policy)."""
        snap = self._sim.latest() if self._sim is not None else None
        return dict(snap.info) if snap is not None else {}

    def tool_position(self, command: np.ndarray) -> np.ndarray:
        """Forward kinematics: tool-centre point (x, y, z) of a joint command (for the workspace box)."""
        import mujoco

        fd = self._fk_data
        fd.qpos[self._qadr] = command[:5]
        mujoco.mj_kinematics(self._model, fd)
        return fd.site_xpos[self._tcp].copy()
