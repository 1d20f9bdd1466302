"""The policy worker: a separate process that loads a policy, receives the latest observation
over the transport and answers with an action chunk (or waypoints).

    python -m robopolicy.deploy.worker --endpoint ipc:///tmp/rp.sock --policy sine:amp=0.3

Policy specs (:func:`load_policy`):

* ``hold``                      — chunk repeating the observed state (arm stands still)
* ``sine[:amp=0.2,freq=0.5,joints=0-4]`` — joint-space sine around the first observed state
* ``arc[:v=0.3,omega=0.2]``     — base waypoints of a constant twist
* ``replay:FILE.npz``           — replays ``action (T, A)`` (or ``waypoints (T, K, 3)``) in time
* a checkpoint directory        — the trained Policy (plugs in through :func:`load_checkpoint`)

Any option may be given as ``key=value`` after the name; ``horizon`` and ``dt`` set the chunk,
``work_ms`` burns that much CPU per prediction (benchmarks: inference load without a model).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hardware.transport import Message, PolicyServer


class WorkerPolicy(Protocol):
    """What the worker runs. ``kind``: "action" → ``(H, A)`` chunk; "waypoints" → ``(K, 3)``.
    ``dt``: spacing of the chunk's steps in seconds. ``predict`` gets one observation (numpy
    arrays under LeRobot keys plus ``task``) and the observation's time ``t``."""

    kind: str
    dt: float

    def predict(self, obs: dict[str, Any], t: float) -> np.ndarray: ...

    def reset(self) -> None: ...


class HoldPolicy:
    """Repeat the observed state: an arm holds still."""

    kind = "action"

    def __init__(self, horizon: int = 20, dt: float = 0.05):
        self.horizon, self.dt = int(horizon), float(dt)

    def predict(self, obs, t):
        state = np.asarray(obs["observation.state"], dtype=np.float32)
        return np.repeat(state[None], self.horizon, axis=0)

    def reset(self):
        pass


class SinePolicy:
    """Joint-space sine around the first observed state, continuous in time across chunks."""

    kind = "action"

    def __init__(self, amp: float = 0.2, freq: float = 0.5, joints: str = "0-4", horizon: int = 20, dt: float = 0.05):
        self.amp, self.freq, self.horizon, self.dt = float(amp), float(freq), int(horizon), float(dt)
        lo, _, hi = str(joints).partition("-")
        self.joints = list(range(int(lo), int(hi or lo) + 1))
        self.reset()

    def reset(self):
        self.center = None
        self.t0 = None

    def predict(self, obs, t):
        state = np.asarray(obs["observation.state"], dtype=np.float64)
        if self.center is None:
            self.center, self.t0 = state.copy(), t
        ts = t - self.t0 + self.dt * np.arange(self.horizon)
        chunk = np.repeat(self.center[None], self.horizon, axis=0)
        for j in self.joints:
            if j < chunk.shape[1]:
                chunk[:, j] += self.amp * np.sin(2 * math.pi * self.freq * ts + j)
                chunk[:, j] -= self.amp * math.sin(j)  # start at the center: no jump at t0
        return chunk.astype(np.float32)


class ArcPolicy:
    """Base waypoints of a constant twist ``(v, omega)``."""

    kind = "waypoints"

    def __init__(self, v: float = 0.3, omega: float = 0.2, horizon: int = 8, dt: float = 0.1):
        from sim_envs.person_follow.waypoints import arc_waypoints

        self.dt = float(dt)
        self.waypoints = arc_waypoints(float(v), float(omega), self.dt, int(horizon))

    def predict(self, obs, t):
        return self.waypoints

    def reset(self):
        pass


class ReplayPolicy:
    """Replay recorded actions in real time from the first observation on."""

    def __init__(self, path: str, horizon: int = 20, dt: float = 0.05):
        with np.load(path, allow_pickle=False) as data:
            if "waypoints" in data:
                self.kind, self.values = "waypoints", np.asarray(data["waypoints"], dtype=np.float32)
            elif "action" in data:
                self.kind, self.values = "action", np.asarray(data["action"], dtype=np.float32)
            else:
                raise ValueError(f"{path}: needs an 'action' (T, A) or 'waypoints' (T, K, 3) array")
            if "dt" in data:
                dt = float(data["dt"])
        self.horizon, self.dt = int(horizon), float(dt)
        self.reset()

    def reset(self):
        self.t0 = None

    def predict(self, obs, t):
        if self.t0 is None:
            self.t0 = t
        k = min(int(round((t - self.t0) / self.dt)), len(self.values) - 1)
        if self.kind == "waypoints":
            return self.values[k]
        idx = np.minimum(np.arange(k, k + self.horizon), len(self.values) - 1)
        return self.values[idx]


class BusyPolicy:
    """Wraps a policy and burns ``work_ms`` of CPU per prediction (matrix products, like a
    network's forward pass), to load the machine as real inference would in benchmarks."""

    def __init__(self, inner: WorkerPolicy, work_ms: float):
        self.inner, self.work_s = inner, float(work_ms) / 1e3
        self.kind, self.dt = inner.kind, inner.dt
        self._a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)

    def predict(self, obs, t):
        end = time.perf_counter() + self.work_s
        x = self._a
        while time.perf_counter() < end:
            x = np.tanh(x @ self._a)
        return self.inner.predict(obs, t)

    def reset(self):
        self.inner.reset()


SCRIPTED = {"hold": HoldPolicy, "sine": SinePolicy, "arc": ArcPolicy, "replay": ReplayPolicy}


def _parse_options(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"policy option {item!r} must be key=value")
        try:
            out[key.strip()] = float(value) if any(c in value for c in ".e") else int(value)
        except ValueError:
            out[key.strip()] = value
    return out


def _checkpoint_dataset_info(path: Path) -> dict[str, Any]:
    """``meta/info.json`` of the dataset the checkpoint's run trained on, when the run says so."""
    import json

    from robopolicy.config import load_yaml

    for run in (path, path.parent, path.parent.parent):
        cfg_file = run / "train_config.yaml"
        if cfg_file.is_file():
            dataset = (load_yaml(cfg_file).get("data") or {}).get("dataset")
            info = Path(str(dataset)) / "meta" / "info.json" if dataset else None
            return json.loads(info.read_text()) if info is not None and info.is_file() else {}
    return {}


class CheckpointPolicy:
    """A trained checkpoint (a :class:`Policy` or a refined base + residual) behind the
    WorkerPolicy protocol: one numpy observation in, one chunk ``(H, A)`` or waypoints ``(K, 3)`` out.

    ``dt`` is the spacing of the chunk's steps: the control period of the dataset the policy
    was trained on (its fps), unless given.
    """

    def __init__(self, path: Path, dt: float | None = None):
        import torch

        from robopolicy.models.loading import load_policy

        self._torch = torch
        self.policy = load_policy(path, "cpu")
        self.policy.eval()
        inner = getattr(self.policy, "base", None) or self.policy  # a refined checkpoint's language is its base's
        language = getattr(inner, "language", None)
        if language is not None:
            language.warm()
        self.kind = "waypoints" if getattr(self.policy, "output", "chunk") == "waypoints" else "action"
        if dt is None:
            fps = _checkpoint_dataset_info(path).get("fps")
            if not fps:
                raise ValueError(f"{path}: cannot tell the policy's control rate (no train_config.yaml naming "
                                 f"its dataset); pass dt explicitly")
            dt = 1.0 / float(fps)
        self.dt = float(dt)

    def predict(self, obs: dict[str, Any], t: float) -> np.ndarray:
        with self._torch.inference_mode():
            out = self.policy.predict(obs)
        return np.asarray(out[0].cpu().numpy(), dtype=np.float32)

    def reset(self) -> None:
        with self._torch.inference_mode():
            self.policy.reset()


def load_checkpoint(path: Path, dt: float | None = None) -> WorkerPolicy:
    """Load a trained checkpoint directory (plain or refined) as a worker policy."""
    return CheckpointPolicy(path, dt)


def load_policy(spec: str) -> WorkerPolicy:
    """A policy from a spec string (see the module docstring) or a checkpoint directory."""
    if Path(spec).is_dir():
        return load_checkpoint(Path(spec))
    name, _, rest = spec.partition(":")
    if name not in SCRIPTED:
        raise ValueError(f"unknown policy {spec!r}: give a checkpoint directory or one of {sorted(SCRIPTED)}")
    if name == "replay":
        path, _, rest = rest.partition(",")
        if not path:
            raise ValueError("replay needs a file: replay:FILE.npz")
    opts = _parse_options(rest)
    work_ms = opts.pop("work_ms", 0)
    policy = ReplayPolicy(path, **opts) if name == "replay" else SCRIPTED[name](**opts)
    return BusyPolicy(policy, work_ms) if work_ms else policy


class Sessions:
    """Policy state (temporal context, queues, the first observed state) per peer identity.

    A worker serves ``max_sessions`` nodes (one robot by default). A node's session starts with
    its first ``reset`` or ``obs`` and with a policy reset; another identity is refused (an
    ``error`` reply, counted and logged, rate-limited) while every slot holds a session active in
    the last ``idle_timeout`` seconds. A refused peer cannot touch a session's state: its
    ``reset`` and observations never reach that session's policy. Extra sessions run deep
    copies of the loaded policy.
    """

    def __init__(self, policy: WorkerPolicy, max_sessions: int = 1, idle_timeout: float = 5.0):
        import logging

        from hardware.transport.zmq_link import RateLimitedLog

        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.template, self.max_sessions, self.idle_timeout = policy, int(max_sessions), float(idle_timeout)
        self.active: dict[bytes, list] = {}  # ident -> [policy, last seen]
        self.spare: list[WorkerPolicy] = [policy]
        self.refused = 0
        self.say = RateLimitedLog(logging.getLogger("robopolicy.worker"))

    def policy_for(self, ident: bytes, now: float) -> WorkerPolicy | None:
        """The session's policy (opening one if a slot is free or idle), or None: refused."""
        entry = self.active.get(ident)
        if entry is not None:
            entry[1] = now
            return entry[0]
        if len(self.active) >= self.max_sessions:
            idle = [k for k, (_, seen) in self.active.items() if now - seen > self.idle_timeout]
            for k in idle:
                self.spare.append(self.active.pop(k)[0])
        if len(self.active) >= self.max_sessions:
            self.refused += 1
            self.say("session", f"refused peer {ident.hex()[:16]}: this worker serves {self.max_sessions} "
                                f"session(s), all active")
            return None
        import copy

        policy = self.spare.pop() if self.spare else copy.deepcopy(self.template)
        policy.reset()  # a new session never inherits another's context
        self.active[ident] = [policy, now]
        return policy


def serve(server: PolicyServer, policy: WorkerPolicy, parent_pid: int | None = None, max_requests: int | None = None,
          max_sessions: int = 1, idle_timeout: float = 5.0, stop: threading.Event | None = None) -> Sessions:
    """Answer observations until SIGTERM, the parent's death, ``max_requests`` or ``stop`` is set;
    each peer identity gets its own policy state (:class:`Sessions`). Returns the sessions."""
    running = [True]

    def _stop(*_):
        running[0] = False

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
    sessions = Sessions(policy, max_sessions, idle_timeout)
    answered = 0
    while running[0] and not (stop is not None and stop.is_set()):
        if parent_pid is not None and os.getppid() != parent_pid:
            break  # the control node is gone: do not linger
        for ident, msg in server.recv_latest(100):
            if msg.kind == "ping":  # liveness: any authenticated peer, no session state
                server.send(ident, Message("pong", msg.seq, msg.t))
                continue
            if msg.kind not in ("reset", "obs"):
                continue
            session = sessions.policy_for(ident, time.monotonic())
            if session is None:
                server.send(ident, Message("error", msg.seq, msg.t, meta={
                    "reason": "refused: this worker serves another node's session", "refused": True}))
                continue
            if msg.kind == "reset":
                session.reset()
                continue
            obs: dict[str, Any] = dict(msg.arrays)
            obs.update(msg.meta)
            t0 = time.perf_counter()
            try:
                out = np.asarray(session.predict(obs, msg.t))
            except Exception as exc:  # a bad observation must not take the worker down
                server.send(ident, Message("error", msg.seq, msg.t, meta={"reason": f"{type(exc).__name__}: {exc}"[:500]}))
                continue
            infer_ms = (time.perf_counter() - t0) * 1e3
            name = "waypoints" if session.kind == "waypoints" else "action"
            reply = Message("chunk", msg.seq, msg.t, {name: out.astype(np.float32, copy=False)},
                            {"dt": float(session.dt), "infer_ms": infer_ms})
            server.send(ident, reply)
            answered += 1
            if max_requests is not None and answered >= max_requests:
                return sessions
    return sessions


def main(argv: list[str] | None = None) -> int:
    import logging

    p = argparse.ArgumentParser(prog="python -m robopolicy.deploy.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", required=True, help="ipc:///path or tcp://HOST:PORT to bind")
    p.add_argument("--policy", required=True, help="checkpoint directory or scripted spec (hold, sine, arc, replay:FILE)")
    p.add_argument("--auth-key-file", help="file with the shared key (required for tcp:// endpoints)")
    p.add_argument("--insecure-loopback", action="store_true",
                   help="allow tcp://127.0.0.1 without a key (any local user can then connect)")
    p.add_argument("--encrypt", action="store_true",
                   help="CURVE-encrypt a local endpoint too (network endpoints always are); the node must agree")
    p.add_argument("--max-sessions", type=int, default=1, help="nodes served at once, each with its own policy state")
    p.add_argument("--parent-pid", type=int, help="exit when this process is no longer our parent")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    key = Path(args.auth_key_file).read_bytes().strip() if args.auth_key_file else None
    policy = load_policy(args.policy)
    server = PolicyServer(args.endpoint, key, insecure_loopback=args.insecure_loopback, encrypt=args.encrypt or None)
    try:
        serve(server, policy, parent_pid=args.parent_pid, max_sessions=args.max_sessions)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
