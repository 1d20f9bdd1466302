"""The web teleop page in headless Chromium (driven through the DevTools protocol): the page's
joystick drives the simulated arm, its save button commits an episode that lerobot loads, the
camera reaches the page; a closed page is a disconnect."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pytest

pytest.importorskip("fastapi")
websockets_sync = pytest.importorskip("websockets.sync.client")
import robopolicy.data.recorder  # noqa: E402,F401  (lerobot's dataset stack: loaded once, at collection)

from hardware.teleop import TeleopDisconnected, TeleopError, make_teleop  # noqa: E402
from test_hw_doubles import wait_for  # noqa: E402
from test_teleop_session import _cfg  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """Headless Chromium on ``url``; :meth:`js` evaluates an expression in the page."""

    def __init__(self, url: str, profile):
        self.proc = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      f"--user-data-dir={profile}", "--remote-debugging-port=0", url],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        assert wait_for(port_file.exists, timeout=30), "chromium did not open its DevTools port"
        port = int(port_file.read_text().split()[0])
        pages = []
        end = time.monotonic() + 20
        while not pages and time.monotonic() < end:
            pages = [p for p in json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
                     if p.get("type") == "page" and p.get("url", "").startswith(url)]
            time.sleep(0.1)
        self._connection = websockets_sync.connect(pages[0]["webSocketDebuggerUrl"], max_size=None)
        self.ws = self._connection.__enter__()
        self._id = 0

    def js(self, expression: str):
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": "Runtime.evaluate",
                                 "params": {"expression": expression, "returnByValue": True}}))
        while True:
            msg = json.loads(self.ws.recv(timeout=10))
            if msg.get("id") == self._id:
                return msg["result"]["result"].get("value")

    def close(self):
        try:
            self._connection.__exit__(None, None, None)
        finally:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium")
def test_the_web_page_drives_the_sim_arm_and_saves_an_episode(tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from robopolicy.teleop.session import record_session

    device = make_teleop("web", port=0)
    seen: dict = {}
    abort = threading.Event()

    def operator():
        try:
            drive()
        except BaseException as exc:  # noqa: BLE001 - end the session, report it below
            seen["error"] = exc
            abort.set()

    def drive():
        assert wait_for(lambda: device.is_connected, timeout=60)
        browser = Browser(device.url, tmp_path / "profile")
        try:
            assert wait_for(lambda: device.clients == 1, timeout=20)
            browser.js("joystick(1, 0)")  # stick forward: +x
            time.sleep(1.0)
            browser.js("joystick(0, 0)")
            seen["camera"] = wait_for(lambda: browser.js("document.getElementById('cam').src.startsWith('data:image/jpeg')"),
                                      timeout=10)
            browser.js("press('save')")
            time.sleep(0.5)
            browser.js("press('stop')")
            wait_for(lambda: "result" in seen, timeout=30)
        finally:
            browser.close()

    helper = threading.Thread(target=operator, daemon=True)
    helper.start()
    seen["result"] = record_session(_cfg(tmp_path), device=device, on_status=lambda line: None, stop_event=abort)
    helper.join(30)
    assert "error" not in seen, seen.get("error")
    result = seen["result"]
    assert result.fault is None and result.stopped_by == "operator (stop)" and result.episodes == [0]
    assert seen["camera"]
    ds = LeRobotDataset("robopolicy/local", root=tmp_path / "ds", video_backend="pyav")
    assert ds.meta.total_episodes == 1 and len(ds) == result.frames
    actions = np.stack([np.asarray(a) for a in ds.hf_dataset["action"]])
    assert np.abs(actions[-1] - actions[0]).max() > 0.02  # the page's joystick moved the arm
    assert ds[0]["observation.images.front"].shape[-2:] == (32, 32)


def test_web_page_messages_and_a_closed_page(tmp_path):
    device = make_teleop("web", port=0)
    device._take(json.dumps({"axes": {"delta_x": 3.0, "delta_y": -0.5, "gripper": 2}}))
    device._take(json.dumps({"event": "save"}))
    device._take(json.dumps({"event": "format-disk"}))  # not an event: ignored
    device._take("not json")
    device.connect()
    try:
        r = device.read()
        assert r.values["delta_x"] == 1.0 and r.values["delta_y"] == -0.5 and r.values["gripper"] == 2.0
        assert r.events == {"save"} and device.read().events == set()
        with websockets_sync.connect(f"ws://127.0.0.1:{device.port}/ws"):
            assert wait_for(lambda: device.clients == 1)
        assert wait_for(lambda: device.clients == 0)
        with pytest.raises(TeleopDisconnected, match="page closed"):
            device.read()
    finally:
        device.disconnect()
    with pytest.raises(TeleopError, match="loopback"):
        make_teleop("web", host="0.0.0.0")
