"""The daemon's HTTP API and dashboard (FastAPI, served by uvicorn in a thread of its own).

Reads (``GET``) are open; every mutating call (``POST``, ``PUT``) needs
``Authorization: Bearer <token>`` with the token of ``api.token_file``. Without a token file the
API binds loopback only and every mutating call is refused: :func:`check_config` refuses any other
address without one, and :class:`ApiServer` checks it again before binding.

    GET  /livez            the process answers
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

import hmac
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Body, Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from robopolicy.config import ConfigError

if TYPE_CHECKING:
    from robopolicy.deploy.daemon import ApiConfig, Daemon

DASHBOARD = Path(__file__).parent / "dashboard"


def create_app(daemon: "Daemon", token: "str | None"):
    """The FastAPI app over a daemon; ``token`` None refuses every mutating call."""
    from robopolicy.deploy.metrics import DaemonMetrics

    metrics = daemon.metrics or DaemonMetrics(daemon)
    app = FastAPI(title="robopolicy serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics

    def authorized(request: Request) -> None:
        if token is None:
            raise HTTPException(403, "this daemon has no api.token_file: mutating calls are disabled")
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise HTTPException(401, "a valid 'Authorization: Bearer <token>' header is required",
                                headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(authorized)]

    @app.get("/livez")
    async def livez():
        return {"live": True}

    @app.get("/readyz")
    async def readyz():
        ok, why = daemon.ready()
        return JSONResponse({"ready": ok, "why": why}, status_code=200 if ok else 503)

    @app.get("/status")
    async def status():
        return daemon.status()

    @app.get("/metrics")
    async def get_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/timing")
    async def timing(ticks: int = 500):
        import numpy as np

        node = daemon.node
        if node is None:
            raise HTTPException(503, "no control loop yet")
        late = node.timer.recent(max(1, min(int(ticks), 65536))) * 1e6
        pct = (lambda q: float(np.percentile(late, q))) if len(late) else (lambda q: None)
        return {"ticks_total": node.timer.n, "window": int(len(late)), "missed": node.timer.missed,
                "lateness_us": {"p50": pct(50), "p99": pct(99), "max": float(late.max()) if len(late) else None}}

    @app.get("/history")
    async def history(seconds: float = 5.0):
        return daemon.history_since(max(0.1, min(seconds, 20.0)))

    @app.get("/camera/{name}.jpg")
    def camera(name: str):
        import cv2

        obs = daemon.node.last_obs if daemon.node is not None else None
        img = None if obs is None else obs.get(f"observation.images.{name}")
        if img is None:
            raise HTTPException(404, f"no camera {name!r}")
        ok, buf = cv2.imencode(".jpg", img[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 80])
        if not ok:
            raise HTTPException(500, "JPEG encoding failed")
        return Response(buf.tobytes(), media_type="image/jpeg", headers={"Cache-Control": "no-store"})

    @app.get("/")
    def dashboard():
        return FileResponse(DASHBOARD / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/dashboard.js")
    def dashboard_js():
        return FileResponse(DASHBOARD / "dashboard.js", media_type="text/javascript", headers={"Cache-Control": "no-store"})

    @app.post("/estop", dependencies=auth)
    def estop():
        daemon.estop("api")
        return {"estop": True}

    @app.post("/faults/reset", dependencies=auth)
    def faults_reset():
        ok, why = daemon.reset_faults()
        return JSONResponse({"reset": ok, "why": why}, status_code=200 if ok else 409)

    @app.post("/episodes/start", dependencies=auth)
    def episodes_start(body: dict[str, Any] | None = Body(None)):
        task = (body or {}).get("task")
        ok, info = daemon.start_episode(None if task is None else str(task))
        return JSONResponse({"started": ok, "episode" if ok else "why": info}, status_code=200 if ok else 409)

    @app.post("/episodes/stop", dependencies=auth)
    def episodes_stop(body: dict[str, Any] | None = Body(None)):
        success = (body or {}).get("success")
        ok, info = daemon.stop_episode(None if success is None else bool(success))
        return JSONResponse({"stopped": ok, "episode" if ok else "why": info}, status_code=200 if ok else 409)

    @app.put("/policy", dependencies=auth)
    def put_policy(body: dict[str, Any] = Body(...)):
        spec = body.get("checkpoint") or body.get("policy")
        if not isinstance(spec, str) or not spec:
            raise HTTPException(422, "give {'checkpoint': 'DIR or scripted spec'}")
        ok, why = daemon.swap_policy(spec)
        return JSONResponse({"swapped": ok, "policy": daemon.policy, "why": why}, status_code=200 if ok else 409)

    @app.exception_handler(HTTPException)
    def http_error(request, exc):
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    return app


class ApiServer:
    """uvicorn in its own thread, on a socket bound here (``port`` 0: an ephemeral one)."""

    def __init__(self, daemon: "Daemon", cfg: "ApiConfig"):
        from robopolicy.deploy.daemon import is_loopback, read_token

        self.token = read_token(cfg.token_file) if cfg.token_file else None
        if self.token is None and not is_loopback(cfg.host):
            raise ConfigError(f"api.host: {cfg.host} is not loopback; binding it needs api.token_file")
        self.app = create_app(daemon, self.token)
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # uvicorn writes a response in more than one segment: without NODELAY a keep-alive client
        # waits out its delayed ACK (about 40 ms) on every request
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind((cfg.host, cfg.port))
        self.port = self.sock.getsockname()[1]
        self.host = cfg.host
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        import uvicorn

        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]},
                                        name="deploy-api", daemon=True)
        self._thread.start()
        for _ in range(500):
            if self._server.started:
                return
            threading.Event().wait(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(5.0)
        self.sock.close()
