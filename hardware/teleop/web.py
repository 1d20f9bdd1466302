"""WebTeleop: a teleop page served on localhost (FastAPI + a WebSocket).

The page has a virtual joystick (x/y), up/down and gripper buttons, the keys of the keyboard
device (w/s, a/d, u/j, o/c), the live camera, the episode buttons (save, re-record, discard,
stop, good, bad) and take over / give back. The browser sends its axes and button presses over
the WebSocket; :meth:`WebTeleop.read` returns them as deltas with events, and sends the newest
camera frame back (JPEG) with the observation it was given. The server runs in its own thread;
it binds a loopback address only. A page that closes mid-session is a disconnect.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time
from typing import Any

import numpy as np
from fastapi import FastAPI, WebSocket, WebSocketDisconnect  # module level: FastAPI resolves the annotations here
from fastapi.responses import HTMLResponse

from hardware.teleop.base import EVENTS, TeleopDisconnected, TeleopError, TeleopReading

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>robopolicy teleop</title>
<style>
body{font-family:sans-serif;margin:1em;background:#111;color:#eee}
#pad{width:200px;height:200px;border-radius:50%;background:#333;position:relative;touch-action:none}
#knob{width:60px;height:60px;border-radius:50%;background:#8ac;position:absolute;left:70px;top:70px}
button{margin:3px;padding:8px 12px;font-size:15px}
#cam{width:320px;height:320px;image-rendering:pixelated;background:#000}
.row{display:flex;gap:16px;align-items:flex-start}
</style></head><body>
<h3>robopolicy teleop <span id="state">connecting</span></h3>
<div class="row">
 <img id="cam" alt="camera">
 <div>
  <div id="pad"><div id="knob"></div></div>
  <div><button id="up">up (u)</button><button id="down">down (j)</button></div>
  <div><button id="open">open (o)</button><button id="close">close (c)</button></div>
  <div><button data-event="save">save (n)</button><button data-event="rerecord">re-record (r)</button>
   <button data-event="discard">discard (x)</button><button data-event="stop">stop (t)</button></div>
  <div><button data-event="success">good (g)</button><button data-event="failure">bad (b)</button>
   <button data-event="toggle">take over / give back (i)</button></div>
  <pre id="status"></pre>
 </div>
</div>
<script>
const axes={delta_x:0,delta_y:0,delta_z:0,gripper:1};
const ws=new WebSocket(`ws://${location.host}/ws`);
const held=new Set();
function send(){if(ws.readyState===1)ws.send(JSON.stringify({axes:axes}));}
function press(name){if(ws.readyState===1)ws.send(JSON.stringify({event:name}));}
function joystick(x,y){axes.delta_x=x;axes.delta_y=y;const k=document.getElementById('knob');
 k.style.left=(70-70*y)+'px';k.style.top=(70-70*x)+'px';send();}
ws.onopen=()=>{document.getElementById('state').textContent='connected';send();};
ws.onclose=()=>{document.getElementById('state').textContent='disconnected';};
ws.onmessage=(m)=>{const d=JSON.parse(m.data);if(d.image)document.getElementById('cam').src=d.image;
 if(d.status)document.getElementById('status').textContent=d.status;};
const pad=document.getElementById('pad');
function padMove(e){const r=pad.getBoundingClientRect();let y=-((e.clientX-r.left)/r.width*2-1),x=-((e.clientY-r.top)/r.height*2-1);
 const n=Math.hypot(x,y);if(n>1){x/=n;y/=n;}joystick(x,y);}
pad.onpointerdown=(e)=>{pad.setPointerCapture(e.pointerId);padMove(e);};
pad.onpointermove=(e)=>{if(e.buttons)padMove(e);};
pad.onpointerup=()=>joystick(0,0);
function hold(id,key,val){const b=document.getElementById(id);
 b.onpointerdown=()=>{axes[key]=val;send();};b.onpointerup=b.onpointerleave=()=>{axes[key]=key==='gripper'?1:0;send();};}
hold('up','delta_z',1);hold('down','delta_z',-1);hold('open','gripper',2);hold('close','gripper',0);
document.querySelectorAll('button[data-event]').forEach(b=>b.onclick=()=>press(b.dataset.event));
const keyAxes={w:['delta_x',1],s:['delta_x',-1],a:['delta_y',1],d:['delta_y',-1],u:['delta_z',1],j:['delta_z',-1],o:['gripper',2],c:['gripper',0]};
const keyEvents={n:'save',r:'rerecord',x:'discard',t:'stop',g:'success',b:'failure',i:'toggle'};
document.onkeydown=(e)=>{if(e.repeat)return;if(keyAxes[e.key]){axes[keyAxes[e.key][0]]=keyAxes[e.key][1];send();}
 else if(keyEvents[e.key])press(keyEvents[e.key]);};
document.onkeyup=(e)=>{if(keyAxes[e.key]){const k=keyAxes[e.key][0];axes[k]=k==='gripper'?1:0;send();}};
</script></body></html>
"""


class WebTeleop:
    """The teleop page at ``http://host:port/`` (``port`` 0: an ephemeral one, see :attr:`url`).

    ``camera``: the observation key shown live (the first camera when None); ``image_hz``: how
    often a frame is sent to the page.
    """

    name = "web"

    def __init__(self, host: str = "127.0.0.1", port: int = 8765, camera: str | None = None, image_hz: float = 10.0):
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise TeleopError(f"the web teleop page binds loopback only (got host {host!r}); reach it through an "
                              f"SSH tunnel from another machine")
        self.host, self.camera, self.image_period = host, camera, 1.0 / float(image_hz)
        self._lock = threading.Lock()
        self._axes = {"delta_x": 0.0, "delta_y": 0.0, "delta_z": 0.0, "gripper": 1.0}
        self._events: set[str] = set()
        self._clients = 0
        self._ever_connected = False
        self._frame: str | None = None  # the newest camera frame as a data URL
        self._status = ""
        self._next_image = 0.0
        self._server = None
        self._thread: threading.Thread | None = None
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, int(port)))
        except OSError as exc:
            raise TeleopError(f"web teleop: cannot bind {host}:{port}: {exc}") from None
        self.port = self.sock.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{'[' + self.host + ']' if ':' in self.host else self.host}:{self.port}/"

    @property
    def is_connected(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def clients(self) -> int:
        return self._clients

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/")
        def page() -> HTMLResponse:
            return HTMLResponse(PAGE)

        @app.websocket("/ws")
        async def ws(sock: WebSocket) -> None:
            await sock.accept()
            with self._lock:
                self._clients += 1
                self._ever_connected = True
            sent = None
            try:
                while True:
                    try:
                        text = await asyncio.wait_for(sock.receive_text(), timeout=self.image_period)
                        self._take(text)
                    except asyncio.TimeoutError:
                        pass
                    frame = self._frame
                    if frame is not None and frame is not sent:
                        await sock.send_text(json.dumps({"image": frame, "status": self._status}))
                        sent = frame
            except WebSocketDisconnect:
                pass
            finally:
                with self._lock:
                    self._clients -= 1

        return app

    def _take(self, text: str) -> None:
        """One message from the page: ``{"axes": {...}}`` or ``{"event": name}`` (others ignored)."""
        try:
            msg = json.loads(text)
        except ValueError:
            return
        if not isinstance(msg, dict):
            return
        with self._lock:
            axes = msg.get("axes")
            if isinstance(axes, dict):
                for k in self._axes:
                    v = axes.get(k)
                    if isinstance(v, (int, float)) and np.isfinite(v):
                        self._axes[k] = float(np.clip(v, 0.0, 2.0) if k == "gripper" else np.clip(v, -1.0, 1.0))
            if msg.get("event") in EVENTS:
                self._events.add(msg["event"])

    def connect(self) -> None:
        import uvicorn

        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]},
                                        name="web-teleop", daemon=True)
        self._thread.start()
        end = time.monotonic() + 10.0
        while not self._server.started and time.monotonic() < end:
            time.sleep(0.01)
        if not self._server.started:
            raise TeleopError(f"web teleop: the server on {self.url} did not start")

    def read(self, observation: dict[str, Any] | None = None) -> TeleopReading:
        if not self.is_connected:
            raise TeleopDisconnected("web teleop server stopped")
        with self._lock:
            if self._ever_connected and self._clients == 0:
                raise TeleopDisconnected("the teleop page closed its connection")
            values, events, self._events = dict(self._axes), self._events, set()
        if observation is not None and time.monotonic() >= self._next_image:
            self._next_image = time.monotonic() + self.image_period
            self._frame = self._encode(observation)
        return TeleopReading(values, "delta", events, time.monotonic())

    def _encode(self, observation: dict[str, Any]) -> str | None:
        keys = [k for k in observation if k.startswith("observation.images.")]
        key = f"observation.images.{self.camera}" if self.camera else (keys[0] if keys else None)
        img = observation.get(key) if key else None
        if img is None:
            return self._frame
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(np.asarray(img, np.uint8)).save(buf, format="JPEG", quality=80)
        return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()

    def status(self, line: str) -> None:
        """A status line shown on the page (episodes, frames, time)."""
        self._status = line

    def disconnect(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(5.0)
        self._thread = None
        self.sock.close()
