// The daemon's dashboard: polls /status, /history and the camera JPEGs; actions POST with the token.
"use strict";
const $ = (id) => document.getElementById(id);
const COLORS = ["#e6194b", "#3cb44b", "#ffe119", "#4363d8", "#f58231", "#911eb4", "#46f0f0", "#f032e6"];
const SECONDS = 5;
let cameras = [];

function setPill(el, text, cls) { el.textContent = text; el.className = "pill " + cls; }

async function call(method, path, body) {
  const token = $("token").value.trim();
  const opts = { method, headers: { "Authorization": "Bearer " + token } };
  if (body !== undefined) { opts.headers["Content-Type"] = "application/json"; opts.body = JSON.stringify(body); }
  try {
    const r = await fetch(path, opts);
    const data = await r.json().catch(() => ({}));
    $("message").textContent = r.ok ? `${method} ${path}: ok` : `${method} ${path}: ${r.status} ${data.error || data.why || ""}`;
    return data;
  } catch (e) { $("message").textContent = `${method} ${path}: ${e}`; }
}

function renderState(s) {
  $("robot").textContent = s.robot;
  $("policy").textContent = s.policy;
  setPill($("ready"), s.ready ? "ready" : "not ready", s.ready ? "ok" : "bad");
  const f = s.node && s.node.fault;
  setPill($("fault"), f ? "FAULT " + f.code : "no fault", f ? "bad" : "ok");
  $("why").textContent = s.why;
  const rows = (s.names || []).map((n, i) =>
    `<tr><td>${n}</td><td data-joint="${i}">${s.state ? s.state[i].toFixed(4) : "-"}</td>` +
    `<td>${s.command ? s.command[i].toFixed(4) : "-"}</td></tr>`);
  $("state").innerHTML = "<tr><td></td><td>state</td><td>command</td></tr>" + rows.join("");
  const n = s.node || {};
  $("loop").textContent = `ticks ${n.ticks} @ ${Math.round(n.rate_hz)} Hz, p99 lateness ${Math.round(n.p99_lateness_us)} us, ` +
    `missed ${n.missed}, clamps ${n.clamps}, worker restarts ${s.worker_restarts}`;
  const r = s.recording || {};
  $("recording").textContent = !r.enabled ? "disabled" :
    `${r.state}${r.paused_reason ? " (" + r.paused_reason + ")" : ""}` +
    (r.episode ? `, episode ${r.episode.id}: ${r.episode.frames} frames` : "") +
    `, saved ${r.episodes_saved}, dropped frames ${r.frames_dropped}, queue ${r.queue_depth}`;
  $("faults").innerHTML = (s.fault_history || []).slice().reverse()
    .map((x) => `<li>${new Date(x.ts * 1000).toLocaleTimeString()} ${x.code}: ${x.reason}</li>`).join("");
  if (JSON.stringify(s.cameras) !== JSON.stringify(cameras)) {
    cameras = s.cameras || [];
    $("cams").innerHTML = cameras.map((c) => `<img id="cam-${c}" alt="${c}" title="${c}">`).join("");
  }
}

function plot(h) {
  const c = $("plot"), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  if (!h.t.length) return;
  let lo = Infinity, hi = -Infinity;
  for (const rows of [h.state, h.command]) for (const r of rows) if (r) for (const v of r) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  if (hi - lo < 1e-6) { hi += 0.5; lo -= 0.5; }
  const x = (t) => c.width * (1 + t / SECONDS), y = (v) => c.height * (1 - (v - lo) / (hi - lo));
  const dims = h.state[0].length;
  for (let j = 0; j < dims; j++) {
    for (const [rows, dash] of [[h.state, []], [h.command, [4, 4]]]) {
      g.strokeStyle = COLORS[j % COLORS.length]; g.setLineDash(dash); g.beginPath();
      let started = false;
      rows.forEach((r, i) => { if (!r) return; const px = x(h.t[i]), py = y(r[j]); started ? g.lineTo(px, py) : g.moveTo(px, py); started = true; });
      g.stroke();
    }
  }
}

async function tick() {
  try {
    const s = await (await fetch("/status")).json();
    renderState(s);
    plot(await (await fetch(`/history?seconds=${SECONDS}`)).json());
    const stamp = Date.now();
    for (const cam of cameras) { const img = $("cam-" + cam); if (img) img.src = `/camera/${cam}.jpg?t=${stamp}`; }
  } catch (e) {
    setPill($("ready"), "daemon unreachable", "bad");
  }
  setTimeout(tick, 250);
}

$("estop").onclick = () => call("POST", "/estop");
$("reset").onclick = () => call("POST", "/faults/reset");
$("ep-start").onclick = () => call("POST", "/episodes/start", {});
$("ep-stop").onclick = () => call("POST", "/episodes/stop", {});
$("seconds").textContent = SECONDS;
tick();
