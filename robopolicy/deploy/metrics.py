"""Prometheus metrics of the daemon, read from the node and the daemon at scrape time.

The daemon gathers every value as plain data (:meth:`DaemonMetrics.facts`) with each snapshot it
sends the API process; that process formats them (:func:`render_facts`), so a scrape costs the
daemon nothing. The loop lateness and inference latency histograms are cumulative over the run:
:meth:`DaemonMetrics.sample` folds the ticks recorded since its last call into fixed buckets
(numpy, no per-tick Python); the supervisor calls it every period.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from robopolicy.deploy.daemon import Daemon

LATENESS_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3)
INFER_BUCKETS = (1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 100e-3, 200e-3, 500e-3, 1.0)


class _Histogram:
    """Cumulative bucket counts of values folded in batches."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = np.asarray(bounds)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)  # last: above every bound
        self.sum = 0.0

    def add(self, values: np.ndarray) -> None:
        if len(values):
            idx = np.searchsorted(self.bounds, values, side="left")
            self.counts += np.bincount(idx, minlength=len(self.counts))
            self.sum += float(values.sum())


class DaemonMetrics:
    """The ``robopolicy_*`` metrics of one daemon."""

    def __init__(self, daemon: "Daemon"):
        self.daemon = daemon
        self.lateness = _Histogram(LATENESS_BUCKETS)
        self.infer = _Histogram(INFER_BUCKETS)
        self._tick_count = 0
        self._source = None
        self._replies = 0
        self._lock = threading.Lock()

    def sample(self) -> None:
        """Fold the ticks and inference times recorded since the last call into the histograms."""
        node = self.daemon.node
        if node is None:
            return
        with self._lock:
            timer = node.timer
            if hasattr(timer, "since"):
                values, self._tick_count = timer.since(self._tick_count)
            else:
                n = timer.n
                values, self._tick_count = timer.lateness[self._tick_count:n].copy(), n
            self.lateness.add(values)
            src = node.source
            if src is not self._source:
                self._source, self._replies = src, 0
            replies = getattr(src, "replies", 0)
            new = replies - self._replies
            if new > 0:
                recent = list(getattr(src, "infer_ms", ()))[-new:]
                self.infer.add(np.asarray(recent, dtype=np.float64) / 1e3)
                self._replies = replies

    def render(self) -> tuple[bytes, str]:
        self.sample()
        return render_facts(self.facts())

    def facts(self) -> dict:
        """Every metric's value as plain data (JSON-able): what :func:`render_facts` formats."""
        d = self.daemon
        node = d.node
        ok, _ = d.ready()
        out: dict = {"ready": ok, "connected": d.connected, "node": None}
        if node is None:
            return out
        timer = node.timer
        counts: dict[str, int] = {}
        for f in list(node.faults.history):
            counts[f.code] = counts.get(f.code, 0) + 1
        active = node.faults.active
        src = node.source
        rt = list(getattr(src, "round_trips", ()))[-256:]
        w = d.writer
        with self._lock:
            lateness = (self.lateness.counts.tolist(), self.lateness.sum)
            infer = (self.infer.counts.tolist(), self.infer.sum)
        out["node"] = {
            "lateness": lateness, "infer": infer, "ticks": timer.n, "missed": timer.missed, "skipped": timer.skipped,
            "stalls": node.stalls, "driver_errors": node.driver_errors, "faults": counts,
            "active": None if active is None else active.code, "clamps": dict(node.safety.counts),
            "round_trip_p50": float(np.median(rt)) if rt else float("nan"),
            "worker": {k: getattr(src, k, 0) for k in ("sent", "replies", "timeouts")},
            "in_flight": getattr(src, "_in_flight", None) is not None,
            "restarts": d.worker_restarts, "swaps": d.policy_swaps, "refusals": d.policy_refusals,
            "writer": None if w is None else {
                "saved": w.episodes_saved, "failed": w.episodes_failed, "active": w.episode is not None,
                "paused": bool(w.paused_reason), "frames": w.frames_written, "dropped": w.frames_dropped,
                "rotated": w.rotated_segments, "queue": w.queue.qsize()},
        }
        return out


def _histogram(name: str, doc: str, bounds: tuple[float, ...], counts_sum) -> HistogramMetricFamily:
    counts, total = counts_sum
    cum = np.cumsum(counts)
    buckets = [(repr(float(b)), int(c)) for b, c in zip(bounds, cum[:-1])] + [("+Inf", int(cum[-1]))]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class _Facts:
    def __init__(self, facts: dict):
        self._facts = facts

    def collect(self):
        f = self._facts
        yield GaugeMetricFamily("robopolicy_ready", "1 when /readyz is ready", value=1.0 if f["ready"] else 0.0)
        yield GaugeMetricFamily("robopolicy_robot_connected", "1 while the robot is connected",
                                value=1.0 if f["connected"] else 0.0)
        n = f.get("node")
        if n is None:
            return
        yield _histogram("robopolicy_loop_lateness_seconds", "tick start minus its deadline", LATENESS_BUCKETS,
                         n["lateness"])
        yield CounterMetricFamily("robopolicy_loop_ticks", "control loop ticks", value=n["ticks"])
        yield CounterMetricFamily("robopolicy_loop_missed_ticks", "ticks whose work ended after the next deadline",
                                  value=n["missed"])
        yield CounterMetricFamily("robopolicy_loop_skipped_ticks", "deadlines jumped over after an overrun",
                                  value=n["skipped"])
        yield CounterMetricFamily("robopolicy_loop_stalls", "times the process was not run for > driver_timeout/2",
                                  value=n["stalls"])
        yield CounterMetricFamily("robopolicy_driver_errors", "driver calls that raised", value=n["driver_errors"])
        faults = CounterMetricFamily("robopolicy_faults", "faults latched, by kind", labels=["code"])
        for code, k in sorted(n["faults"].items()):
            faults.add_metric([code], k)
        yield faults
        gauge = GaugeMetricFamily("robopolicy_fault_active", "1 while a fault is latched (by kind)", labels=["code"])
        gauge.add_metric(["any"], 1.0 if n["active"] is not None else 0.0)
        if n["active"] is not None:
            gauge.add_metric([n["active"]], 1.0)
        yield gauge
        clamps = CounterMetricFamily("robopolicy_safety_clamps", "commands the safety filter limited, by kind",
                                     labels=["kind"])
        for kind, k in sorted(n["clamps"].items()):
            clamps.add_metric([kind], k)
        yield clamps
        yield _histogram("robopolicy_inference_seconds", "policy worker inference time per chunk", INFER_BUCKETS,
                         n["infer"])
        yield GaugeMetricFamily("robopolicy_round_trip_seconds_p50", "observation to chunk round trip, last 256",
                                value=n["round_trip_p50"])
        for name, key, doc in (("robopolicy_worker_requests", "sent", "observations sent to the worker"),
                               ("robopolicy_worker_replies", "replies", "chunks received from the worker"),
                               ("robopolicy_worker_timeouts", "timeouts", "requests given up")):
            yield CounterMetricFamily(name, doc + " (this worker)", value=n["worker"][key])
        yield CounterMetricFamily("robopolicy_worker_restarts", "policy worker restarts", value=n["restarts"])
        yield CounterMetricFamily("robopolicy_policy_swaps", "policies hot-swapped", value=n["swaps"])
        yield CounterMetricFamily("robopolicy_policy_refusals", "policy swaps refused", value=n["refusals"])
        w = n["writer"]
        if w is not None:
            yield CounterMetricFamily("robopolicy_episodes_saved", "episodes committed", value=w["saved"])
            yield CounterMetricFamily("robopolicy_episodes_failed", "episodes lost to a recording error",
                                      value=w["failed"])
            yield GaugeMetricFamily("robopolicy_episode_active", "1 while an episode runs",
                                    value=1.0 if w["active"] else 0.0)
            yield GaugeMetricFamily("robopolicy_recording_paused", "1 while recording is paused (disk)",
                                    value=1.0 if w["paused"] else 0.0)
            yield CounterMetricFamily("robopolicy_frames_recorded", "frames written", value=w["frames"])
            yield CounterMetricFamily("robopolicy_frames_dropped", "frames dropped (writer queue full)",
                                      value=w["dropped"])
            yield CounterMetricFamily("robopolicy_segments_rotated", "dataset segments deleted by the quota",
                                      value=w["rotated"])
        queues = GaugeMetricFamily("robopolicy_queue_depth", "items waiting, by queue", labels=["queue"])
        queues.add_metric(["recorder"], float(w["queue"]) if w is not None else 0.0)
        queues.add_metric(["worker_in_flight"], 1.0 if n["in_flight"] else 0.0)
        yield queues


def render_facts(facts: dict) -> tuple[bytes, str]:
    """Prometheus text of :meth:`DaemonMetrics.facts` (in the daemon or in the API process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Facts(facts))
    return generate_latest(registry), CONTENT_TYPE_LATEST
