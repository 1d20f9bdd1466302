"""The daemon's HTTP API and dashboard: FastAPI + uvicorn in a process of their own.

The daemon binds the listening socket (so it decides the address and knows the port) and starts
``python -m robopolicy.deploy.api`` with that socket and one end of a socket pair. Over the pair
(JSON lines, never pickle) the daemon sends a snapshot ``{"ready", "status", "metrics"}`` every
``SNAPSHOT_PERIOD`` seconds, and answers the calls the API forwards (operator actions, history,
camera, timing). ``/readyz``, ``/status`` and ``/metrics`` are answered from the latest snapshot
in the API process: however many requests arrive, the daemon's own work (and its share of the
GIL beside the control loop) stays one snapshot per period.

Reads (``GET``) are open; every mutating call (``POST``, ``PUT``) needs
``Authorization: Bearer <token>`` with the token of ``api.token_file``. Without a token file the
API binds loopback only and every mutating call is refused: :func:`check_config` refuses any other
address without one, and :class:`ApiProcess` checks it again before binding.

    GET  /livez            the API process answers and hears from the daemon
    GET  /readyz           200 when ready, 503 with the reason otherwise (a latched fault, no policy)
    GET  /status           everything, as JSON
    GET  /metrics          Prometheus text format
    GET  /timing           loop lateness percentiles over the last ticks (?ticks=500)
    GET  /history          joint state and command over the last seconds (?seconds=5)
    GET  /camera/{name}.jpg  the latest camera image
    GET  /                 the dashboard
    POST /episodes/start   {"task": "..."} (optional)
    POST /episodes/stop    {"success": true|false} (optional); answers once the episode is saved
    POST /estop
    POST /faults/reset
    PUT  /policy           {"checkpoint": "DIR or scripted spec"}
"""

from __future__ import annotations

import argparse
import base64
import hmac
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Body, Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from robopolicy.config import ConfigError

if TYPE_CHECKING:
    from robopolicy.deploy.daemon import ApiConfig, Daemon

DASHBOARD = Path(__file__).parent / "dashboard"
SNAPSHOT_PERIOD = 0.025  # seconds between the daemon's snapshots (a fault shows within about this)
STALE_AFTER = 1.0  # a snapshot older than this: the daemon is not answering, not ready


# --------------------------------------------------------------------------------------------
# In the daemon's process
# --------------------------------------------------------------------------------------------


def handle_call(daemon: "Daemon", op: str, args: dict[str, Any]) -> dict[str, Any]:
    """One forwarded call → ``{"code": HTTP status, "body": JSON}``."""
    if op == "estop":
        daemon.estop("api")
        return {"code": 200, "body": {"estop": True}}
    if op == "faults_reset":
        ok, why = daemon.reset_faults()
        return {"code": 200 if ok else 409, "body": {"reset": ok, "why": why}}
    if op == "episodes_start":
        ok, info = daemon.start_episode(args.get("task"))
        return {"code": 200 if ok else 409, "body": {"started": ok, "episode" if ok else "why": info}}
    if op == "episodes_stop":
        ok, info = daemon.stop_episode(args.get("success"))
        return {"code": 200 if ok else 409, "body": {"stopped": ok, "episode" if ok else "why": info}}
    if op == "policy":
        ok, why = daemon.swap_policy(str(args["spec"]))
        return {"code": 200 if ok else 409, "body": {"swapped": ok, "policy": daemon.policy, "why": why}}
    if op == "history":
        return {"code": 200, "body": daemon.history_since(float(args.get("seconds", 5.0)))}
    if op == "timing":
        return {"code": 200, "body": daemon.timing(int(args.get("ticks", 500)))}
    if op == "camera":
        import cv2

        obs = daemon.node.last_obs if daemon.node is not None else None
        img = None if obs is None else obs.get(f"observation.images.{args.get('name')}")
        if img is None:
            return {"code": 404, "body": {"error": f"no camera {args.get('name')!r}"}}
        ok, buf = cv2.imencode(".jpg", img[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 80])
        return {"code": 200, "body": {"jpeg": base64.b64encode(buf.tobytes()).decode()}}
    return {"code": 400, "body": {"error": f"unknown call {op!r}"}}


def _plain_json(obj: Any) -> Any:
    """NaN and infinities as None (JSON has neither)."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: _plain_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain_json(v) for v in obj]
    return obj


class ApiProcess:
    """The API process, its listening socket and the bridge to it (two daemon threads: one sends
    the snapshots, one takes the calls and answers each from a thread of its own)."""

    def __init__(self, daemon: "Daemon", cfg: "ApiConfig"):
        from robopolicy.deploy.daemon import is_loopback, read_token

        if cfg.token_file is None and not is_loopback(cfg.host):
            raise ConfigError(f"api.host: {cfg.host} is not loopback; binding it needs api.token_file")
        if cfg.token_file is not None:
            read_token(cfg.token_file)
        self.daemon, self.cfg = daemon, cfg
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        self.listen = socket.socket(family, socket.SOCK_STREAM)
        self.listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # uvicorn writes a response in more than one segment: without NODELAY a keep-alive client
        # waits out its delayed ACK (about 40 ms) on every request
        self.listen.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.listen.bind((cfg.host, cfg.port))
        self.port = self.listen.getsockname()[1]
        self.host = cfg.host
        self.sock, self._child_sock = socket.socketpair()
        self.proc: subprocess.Popen | None = None
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        fds = (self.listen.fileno(), self._child_sock.fileno())
        cmd = [sys.executable, "-m", "robopolicy.deploy.api", "--listen-fd", str(fds[0]), "--bridge-fd", str(fds[1])]
        if self.cfg.token_file:
            cmd += ["--token-file", self.cfg.token_file]
        self.proc = subprocess.Popen(cmd, pass_fds=fds, stdin=subprocess.DEVNULL)
        self.listen.close()  # the API process owns it now
        self._child_sock.close()
        rfile = self.sock.makefile("rb")
        self.sock.settimeout(timeout)
        hello = rfile.readline()
        self.sock.settimeout(None)
        if not hello or json.loads(hello).get("type") != "hello":
            raise RuntimeError(f"the API process did not start (exit {self.proc.poll()})")
        for target, name in ((self._publish, "api-snapshots"), (lambda: self._serve(rfile), "api-calls")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def _send(self, msg: dict) -> bool:
        line = (json.dumps(msg, default=str, allow_nan=True) + "\n").encode()
        try:
            with self._send_lock:
                self.sock.sendall(line)
            return True
        except OSError:
            return False

    def snapshot(self) -> dict:
        d = self.daemon
        status = d.status()  # readiness and the fault read once, together
        ok, why = status["ready"], status["why"]
        metrics = d.metrics.facts() if d.metrics is not None else {"connected": d.connected}
        metrics["ready"] = ok
        return {"type": "snapshot", "ready": [ok, why], "status": _plain_json(status), "metrics": metrics}

    def _publish(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                msg = self.snapshot()
            except Exception as exc:  # noqa: BLE001 - a bad snapshot must not end the stream
                msg = {"type": "snapshot", "ready": [False, f"status failed: {exc!r}"[:300]], "status": {},
                       "metrics": {"ready": False, "connected": self.daemon.connected}}
            if not self._send(msg):
                return
            next_t += SNAPSHOT_PERIOD
            self._stop.wait(max(0.0, next_t - time.monotonic()))
            if time.monotonic() - next_t > 1.0:
                next_t = time.monotonic()

    def _serve(self, rfile) -> None:
        for line in rfile:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("type") != "call":
                continue
            threading.Thread(target=self._answer, args=(msg,), name="api-call", daemon=True).start()

    def _answer(self, msg: dict) -> None:
        try:
            result = handle_call(self.daemon, str(msg.get("op")), dict(msg.get("args") or {}))
        except Exception as exc:  # noqa: BLE001
            result = {"code": 500, "body": {"error": f"{type(exc).__name__}: {exc}"[:500]}}
        if msg.get("op") not in ("history", "timing", "camera"):
            # a snapshot ahead of the reply: a client reads its own change at once
            try:
                self._send(self.snapshot())
            except Exception:  # noqa: BLE001
                pass
        self._send({"type": "reply", "id": msg.get("id"), **result})

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        try:
            self.sock.close()
        except OSError:
            pass
        for t in self._threads:
            t.join(2.0)


# --------------------------------------------------------------------------------------------
# In the API process
# --------------------------------------------------------------------------------------------


class Remote:
    """The daemon as the API process sees it: the latest snapshot, and calls over the bridge."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.snapshot: dict | None = None
        self.received = float("nan")
        self.closed = threading.Event()
        self._pending: dict[int, list] = {}
        self._lock = threading.Lock()
        self._next = 0
        self.on_close = lambda: None
        threading.Thread(target=self._read, name="bridge-reader", daemon=True).start()

    def _read(self) -> None:
        for line in self.sock.makefile("rb"):
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("type") == "snapshot":
                self.snapshot, self.received = msg, time.monotonic()
            elif msg.get("type") == "reply":
                waiter = self._pending.pop(msg.get("id"), None)
                if waiter is not None:
                    waiter.append(msg)
                    waiter[0].set()
        self.closed.set()
        for waiter in list(self._pending.values()):
            waiter[0].set()
        self.on_close()

    def fresh(self) -> dict | None:
        snap = self.snapshot
        if snap is None or time.monotonic() - self.received > STALE_AFTER:
            return None
        return snap

    def call(self, op: str, timeout: float = 180.0, **args: Any) -> tuple[int, Any]:
        with self._lock:
            self._next += 1
            ident = self._next
            waiter: list = [threading.Event()]
            self._pending[ident] = waiter
            line = (json.dumps({"type": "call", "id": ident, "op": op, "args": args}) + "\n").encode()
            try:
                self.sock.sendall(line)
            except OSError:
                self._pending.pop(ident, None)
                return 503, {"error": "the daemon is gone"}
        if not waiter[0].wait(timeout) or len(waiter) < 2:
            self._pending.pop(ident, None)
            return 504, {"error": f"the daemon did not answer {op!r} within {timeout:.0f}s"}
        return int(waiter[1]["code"]), waiter[1]["body"]


def create_app(remote: Remote, token: str | None):
    """The FastAPI app over the bridge; ``token`` None refuses every mutating call."""
    from robopolicy.deploy.metrics import render_facts

    app = FastAPI(title="robopolicy serve", docs_url=None, redoc_url=None, openapi_url=None)

    def authorized(request: Request) -> None:
        if token is None:
            raise HTTPException(403, "this daemon has no api.token_file: mutating calls are disabled")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise HTTPException(401, "a valid 'Authorization: Bearer <token>' header is required",
                                headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(authorized)]

    def snapshot() -> dict:
        snap = remote.fresh()
        if snap is None:
            raise HTTPException(503, "no recent snapshot from the daemon")
        return snap

    def forward(op: str, **args: Any) -> JSONResponse:
        code, body = remote.call(op, **args)
        return JSONResponse(body, status_code=code)

    @app.get("/livez")
    async def livez():
        ok = remote.fresh() is not None
        return JSONResponse({"live": ok}, status_code=200 if ok else 503)

    @app.get("/readyz")
    async def readyz():
        snap = remote.fresh()
        ok, why = snap["ready"] if snap is not None else (False, "no recent snapshot from the daemon")
        return JSONResponse({"ready": ok, "why": why}, status_code=200 if ok else 503)

    @app.get("/status")
    async def status():
        return snapshot()["status"]

    @app.get("/metrics")
    async def get_metrics():
        body, content_type = render_facts(snapshot()["metrics"])
        return Response(body, media_type=content_type)

    @app.get("/timing")
    def timing(ticks: int = 500):
        return forward("timing", ticks=ticks)

    @app.get("/history")
    def history(seconds: float = 5.0):
        return forward("history", seconds=max(0.1, min(seconds, 20.0)))

    @app.get("/camera/{name}.jpg")
    def camera(name: str):
        code, body = remote.call("camera", name=name)
        if code != 200:
            return JSONResponse(body, status_code=code)
        return Response(base64.b64decode(body["jpeg"]), media_type="image/jpeg", headers={"Cache-Control": "no-store"})

    @app.get("/")
    def dashboard():
        return FileResponse(DASHBOARD / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/dashboard.js")
    def dashboard_js():
        return FileResponse(DASHBOARD / "dashboard.js", media_type="text/javascript", headers={"Cache-Control": "no-store"})

    @app.post("/estop", dependencies=auth)
    def estop():
        return forward("estop")

    @app.post("/faults/reset", dependencies=auth)
    def faults_reset():
        return forward("faults_reset")

    @app.post("/episodes/start", dependencies=auth)
    def episodes_start(body: dict[str, Any] | None = Body(None)):
        task = (body or {}).get("task")
        return forward("episodes_start", task=None if task is None else str(task))

    @app.post("/episodes/stop", dependencies=auth)
    def episodes_stop(body: dict[str, Any] | None = Body(None)):
        success = (body or {}).get("success")
        return forward("episodes_stop", success=None if success is None else bool(success))

    @app.put("/policy", dependencies=auth)
    def put_policy(body: dict[str, Any] = Body(...)):
        spec = body.get("checkpoint") or body.get("policy")
        if not isinstance(spec, str) or not spec:
            raise HTTPException(422, "give {'checkpoint': 'DIR or scripted spec'}")
        return forward("policy", spec=spec)

    @app.exception_handler(HTTPException)
    def http_error(request, exc):
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    return app


def main(argv: list[str] | None = None) -> int:
    """The API process (started by :class:`ApiProcess`, not by hand)."""
    p = argparse.ArgumentParser(prog="python -m robopolicy.deploy.api", description=main.__doc__)
    p.add_argument("--listen-fd", type=int, required=True)
    p.add_argument("--bridge-fd", type=int, required=True)
    p.add_argument("--token-file")
    args = p.parse_args(argv)
    import os

    import uvicorn

    try:  # on a busy robot computer the daemon's threads (and the loop's GIL) come first
        os.nice(10)
    except OSError:
        pass

    from robopolicy.deploy.daemon import read_token

    token = read_token(args.token_file) if args.token_file else None
    bridge = socket.socket(fileno=args.bridge_fd)
    listen = socket.socket(fileno=args.listen_fd)
    remote = Remote(bridge)
    app = create_app(remote, token)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))

    def daemon_gone():
        server.should_exit = True

    remote.on_close = daemon_gone
    bridge.sendall(b'{"type": "hello"}\n')
    server.run(sockets=[listen])
    return 0


if __name__ == "__main__":
    sys.exit(main())
