"""ZeroMQ sockets for the policy link: the worker binds a ROUTER, the node connects a DEALER.

Endpoints: ``ipc:///path`` on one machine, ``tcp://host:port`` across machines. Binding (or
connecting) anywhere but this machine requires a shared key: every frame set is then tagged and
checked with HMAC-SHA256, so a stranger on the network can neither command nor feed the robot.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from typing import Any

import zmq

from hardware.transport.messages import Limits, Message, MessageError, decode, encode

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
MIN_KEY_BYTES = 16


class TransportError(RuntimeError):
    """The link cannot be set up as asked (e.g. a network bind without an auth key)."""


def is_local(endpoint: str) -> bool:
    """True for ipc://, inproc:// and loopback tcp:// endpoints."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        raise TransportError(f"endpoint {endpoint!r} must look like ipc:///path or tcp://host:port")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        raise TransportError(f"unsupported transport {scheme!r} (use ipc or tcp)")
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host in LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or an interface name (eth0, *): treat as network-facing


def check_bind(endpoint: str, key: bytes | None) -> None:
    """Refuse a network-facing endpoint without an auth key of at least 16 bytes."""
    if not is_local(endpoint) and (key is None or len(key) < MIN_KEY_BYTES):
        raise TransportError(
            f"{endpoint} is reachable from the network: pass an auth key of >= {MIN_KEY_BYTES} bytes "
            "(--auth-key-file) or use ipc:// / tcp://127.0.0.1"
        )


def _socket(ctx: zmq.Context, kind: int, limits: Limits) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # A peer that sends one oversized frame is disconnected by libzmq before we buffer it.
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_array_bytes + limits.max_header_bytes)
    return sock


class PolicyServer:
    """Worker side: receives observations from any number of nodes, answers each by identity."""

    def __init__(self, endpoint: str, key: bytes | None = None, limits: Limits = Limits(), context: zmq.Context | None = None):
        check_bind(endpoint, key)
        self.key, self.limits = key, limits
        self.ctx = context or zmq.Context.instance()
        self.sock = _socket(self.ctx, zmq.ROUTER, limits)
        self.sock.setsockopt(zmq.RCVHWM, 64)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.rejected: Counter[str] = Counter()
        self.last_reject = ""

    def recv_latest(self, timeout_ms: int) -> list[tuple[bytes, Message]]:
        """Wait up to ``timeout_ms`` for messages; returns the newest valid one per sender
        (older queued observations are stale and skipped) plus every non-obs message."""
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return []
        latest: dict[bytes, Message] = {}
        others: list[tuple[bytes, Message]] = []
        # Drain what is queued: EVENTS says whether a message waits (no zmq.Again exception per call).
        while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            ident = bytes(frames[0].buffer)
            try:
                msg = decode([f.buffer for f in frames[1:]], self.key, self.limits)
            except MessageError as exc:
                self.rejected[str(exc).split(":")[0][:60]] += 1
                self.last_reject = str(exc)
                continue
            if msg.kind == "obs":
                latest[ident] = msg
            else:
                others.append((ident, msg))
        return others + list(latest.items())

    def send(self, ident: bytes, msg: Message) -> None:
        self.sock.send_multipart([ident, *encode(msg, self.key)])  # copy: zero-copy sends wake pyzmq's gc thread

    def close(self) -> None:
        self.sock.close(0)


class PolicyClient:
    """Node side: non-blocking send of observations, non-blocking receive of replies."""

    def __init__(self, endpoint: str, key: bytes | None = None, limits: Limits = Limits(), context: zmq.Context | None = None):
        check_bind(endpoint, key)
        self.key, self.limits = key, limits
        self.ctx = context or zmq.Context.instance()
        self.sock = _socket(self.ctx, zmq.DEALER, limits)
        self.sock.setsockopt(zmq.SNDHWM, 4)
        self.sock.setsockopt(zmq.RCVHWM, 16)
        self.sock.connect(endpoint)
        self.rejected: Counter[str] = Counter()
        self.last_reject = ""
        self.send_dropped = 0

    def send(self, msg: Message) -> bool:
        """Queue ``msg``; False (and counted) when the queue is full: never blocks the loop."""
        try:
            self.sock.send_multipart(encode(msg, self.key), zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.send_dropped += 1
            return False

    def poll(self) -> list[Message]:
        """Every valid reply received so far (never blocks); invalid ones are counted, dropped."""
        out = []
        while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(decode(frames, self.key, self.limits))
            except MessageError as exc:
                self.rejected[str(exc).split(":")[0][:60]] += 1
                self.last_reject = str(exc)
        return out

    def stats(self) -> dict[str, Any]:
        return {"rejected": sum(self.rejected.values()), "last_reject": self.last_reject, "send_dropped": self.send_dropped}

    def close(self) -> None:
        self.sock.close(0)
