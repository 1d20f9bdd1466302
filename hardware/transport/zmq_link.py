"""ZeroMQ sockets for the policy link: the worker binds a ROUTER, the node connects a DEALER.

Endpoints: ``ipc:///path`` on one machine, ``tcp://host:port`` across machines.

With a shared key, peers are authenticated when they connect, before any message of theirs is
buffered; the worker's ZAP handler admits only a peer that proves the key, so a peer without it
never completes the handshake: it cannot make the worker buffer anything. A refused handshake is
logged by the worker (rate-limited) and seen at once by the node
(:meth:`PolicyClient.handshake_problem`). How a peer proves the key depends on the channel:

* across a network (``tcp://`` to anything but loopback), or wherever ``encrypt=True``: ZeroMQ's
  CURVE, key pairs derived from the shared key. Every message is encrypted and authenticated
  with a per-connection nonce, so traffic captured on the wire can neither be read nor replayed,
  in its connection or another. It costs the encryption of every byte (a 28 kB observation:
  about 20 us at each end on an idle machine).
* on this machine (``ipc://`` and loopback ``tcp://``): ZeroMQ's PLAIN handshake carrying a token
  derived from the key (never the key itself), checked by the ZAP handler in constant time.
  The kernel already keeps a local connection's bytes from other users (only root can read or
  inject into it), so the messages themselves are not encrypted and the key costs no speed.

Which endpoints need a key: every tcp:// one, loopback included (any local user can connect to
127.0.0.1), unless the caller opts out with ``insecure_loopback``; an ipc:// socket is protected
by its file's permissions (owner only), a key adds the handshake. Both ends must agree on
``encrypt`` (default: by the endpoint, as above; a local node connecting through 127.0.0.1 to a
worker bound to a network address passes ``encrypt=True``). On top of the transport, the server
drops an observation that is not newer than the last one of its peer (a repeated or reordered
``seq``) or older than ``freshness`` seconds (judged against the peer's own clock, offset measured
from its messages).
"""

from __future__ import annotations

import hashlib
import logging
import os
import ipaddress
import time
from collections import Counter
from typing import Any

import zmq
from zmq.utils import z85

from hardware.transport.messages import Limits, Message, MessageError, decode, encode

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
MIN_KEY_BYTES = 16
ZAP_DOMAIN = "robopolicy"
HANDSHAKE_FAILED = {
    getattr(zmq, "EVENT_HANDSHAKE_FAILED_NO_DETAIL", 0x0800): "no detail",
    getattr(zmq, "EVENT_HANDSHAKE_FAILED_PROTOCOL", 0x2000): "protocol (wrong or no key)",
    getattr(zmq, "EVENT_HANDSHAKE_FAILED_AUTH", 0x4000): "refused by the worker's authenticator",
}
EVENT_HANDSHAKE_SUCCEEDED = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", 0x1000)

log = logging.getLogger("robopolicy.transport")


class TransportError(RuntimeError):
    """The link cannot be set up as asked (e.g. a network bind without an auth key)."""


class RateLimitedLog:
    """Logs a kind of event at most once per ``every`` seconds, with the count of the ones held back."""

    def __init__(self, logger: logging.Logger = log, every: float = 5.0):
        self.logger, self.every = logger, float(every)
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def __call__(self, kind: str, text: str) -> bool:
        now = time.monotonic()
        if now - self._last.get(kind, -1e18) < self.every:
            self._held[kind] += 1
            return False
        held, self._held[kind] = self._held[kind], 0
        self._last[kind] = now
        self.logger.warning("%s%s", text, f" ({held} more since the last report)" if held else "")
        return True


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


def check_bind(endpoint: str, key: bytes | None, insecure_loopback: bool = False) -> None:
    """Refuse a tcp:// endpoint without an auth key of at least 16 bytes (a loopback one too,
    unless ``insecure_loopback``); ipc:// is protected by file permissions instead."""
    if key is not None and len(key) < MIN_KEY_BYTES:
        raise TransportError(f"the auth key must have >= {MIN_KEY_BYTES} bytes, got {len(key)}")
    if key is not None or endpoint.startswith(("ipc://", "inproc://")):
        return
    if not is_local(endpoint):
        raise TransportError(
            f"{endpoint} is reachable from the network: pass an auth key of >= {MIN_KEY_BYTES} bytes "
            "(--auth-key-file) or use ipc://"
        )
    if not insecure_loopback:
        raise TransportError(
            f"{endpoint}: any local user can connect to a loopback port: pass an auth key "
            f"(--auth-key-file), use ipc:// (owner-only file permissions) or opt out with insecure_loopback"
        )


def curve_keys(key: bytes, role: str) -> tuple[bytes, bytes]:
    """(public, secret) CURVE key pair of ``role`` ("server" or "client"), derived from the shared key."""
    secret = z85.encode(hashlib.sha256(b"robopolicy-curve-" + role.encode() + b"\0" + key).digest())
    return zmq.curve_public(secret), secret


def plain_token(key: bytes) -> bytes:
    """The PLAIN handshake's password: a one-way derivation of the shared key."""
    return hashlib.sha256(b"robopolicy-plain\0" + key).hexdigest().encode()


def mechanism(endpoint: str, key: bytes | None, encrypt: bool | None = None) -> str:
    """"null" (no key), "curve" (network, or ``encrypt``) or "plain" (this machine)."""
    if key is None:
        return "null"
    if encrypt is None:
        encrypt = not is_local(endpoint)
    return "curve" if encrypt else "plain"


def _check_curve() -> None:
    if not zmq.has("curve"):
        raise TransportError("this libzmq has no CURVE support (libsodium): cannot authenticate the link")


def _authenticator(ctx: zmq.Context, token: bytes | None):
    """A ZAP handler thread; with ``token``, PLAIN passwords are compared in constant time and
    never logged (the stock handler compares with == and logs them at debug level)."""
    import hmac

    from zmq.auth.thread import ThreadAuthenticator

    class Authenticator(ThreadAuthenticator):
        def _authenticate_plain(self, domain, username, password):
            ok = token is not None and hmac.compare_digest(str(password).encode(), token)
            return ok, (b"OK" if ok else b"Invalid password")

    auth = Authenticator(ctx, log=logging.getLogger("robopolicy.transport.zap"))
    auth.start()
    return auth


class _ClientKeyCheck:
    """ZAP credentials provider: admits the one client key derived from the shared key."""

    def __init__(self, allowed: bytes, say: RateLimitedLog):
        self.allowed, self.say, self.denied = allowed, say, 0

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key == self.allowed:
            return True
        self.denied += 1
        self.say("zap", f"refused a connection to the policy link: unknown CURVE client key (wrong auth key?)")
        return False


def _socket(ctx: zmq.Context, kind: int, limits: Limits) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # A peer that sends one oversized frame is disconnected by libzmq before we buffer it.
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_array_bytes + limits.max_header_bytes)
    return sock


def _drain_handshake_events(monitor: zmq.Socket) -> list[tuple[int, str]]:
    """(event, what) of every connection event queued on a monitor socket (never blocks)."""
    out = []
    while monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        event = int.from_bytes(frames[0][:2], "little")
        out.append((event, HANDSHAKE_FAILED.get(event, "ok")))
    return out


class _PeerClock:
    """Replay guard of one peer: its last observation seq and its clock's offset from ours."""

    __slots__ = ("last_seq", "offset")

    def __init__(self) -> None:
        self.last_seq = -1
        self.offset = float("inf")


class PolicyServer:
    """Worker side: receives observations from authenticated nodes, answers each by identity."""

    def __init__(self, endpoint: str, key: bytes | None = None, limits: Limits = Limits(),
                 context: zmq.Context | None = None, insecure_loopback: bool = False,
                 freshness: float = 10.0, log_every: float = 5.0, encrypt: bool | None = None):
        check_bind(endpoint, key, insecure_loopback)
        self.key, self.limits, self.freshness = key, limits, float(freshness)
        self.mechanism = mechanism(endpoint, key, encrypt)
        self.say = RateLimitedLog(log, log_every)
        self.auth = None
        self._own_ctx = key is not None and context is None
        # one ZAP handler per context: a keyed server gets a context of its own
        self.ctx = zmq.Context() if self._own_ctx else (context or zmq.Context.instance())
        self.sock = _socket(self.ctx, zmq.ROUTER, limits)
        self.sock.setsockopt(zmq.RCVHWM, 64)
        self.key_check = None
        if self.mechanism == "curve":
            _check_curve()
            public, secret = curve_keys(key, "server")
            self.key_check = _ClientKeyCheck(curve_keys(key, "client")[0], self.say)
            self.auth = _authenticator(self.ctx, None)
            self.auth.configure_curve_callback(ZAP_DOMAIN, self.key_check)
            self.sock.curve_server = True
            self.sock.curve_publickey, self.sock.curve_secretkey = public, secret
            self.sock.zap_domain = ZAP_DOMAIN.encode()
        elif self.mechanism == "plain":
            self.auth = _authenticator(self.ctx, plain_token(key))
            self.auth.configure_plain(ZAP_DOMAIN, {"robopolicy": "-"})  # the check is the override's
            self.sock.plain_server = True
            self.sock.zap_domain = ZAP_DOMAIN.encode()
        self.monitor = self.sock.get_monitor_socket(sum(HANDSHAKE_FAILED))
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        if self.endpoint.startswith("ipc://"):
            os.chmod(self.endpoint[len("ipc://"):], 0o600)  # owner only: the socket file is the lock
        self.rejected: Counter[str] = Counter()
        self.last_reject = ""
        self.handshakes_refused = 0
        self._peers: dict[bytes, _PeerClock] = {}
        self._poller = zmq.Poller()  # one poller, reused: Socket.poll builds a new one per call
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)

    def _reject(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        self.last_reject = detail
        self.say(reason, f"policy link: dropped a message: {detail[:200]}")

    def _fresh(self, ident: bytes, msg: Message, now: float) -> bool:
        peer = self._peers.get(ident)
        if peer is None:
            if len(self._peers) >= 1024:
                self._peers.clear()
            peer = self._peers[ident] = _PeerClock()
        if msg.seq <= peer.last_seq:
            self._reject("replayed", f"observation seq {msg.seq} not after {peer.last_seq} (repeated or reordered)")
            return False
        lag = now - msg.t
        if lag - peer.offset > self.freshness:
            self._reject("stale", f"observation {lag - peer.offset:.1f} s old (freshness {self.freshness:.1f} s)")
            return False
        peer.offset = min(peer.offset, lag)
        peer.last_seq = msg.seq
        return True

    def _note_handshakes(self) -> None:
        for event, what in _drain_handshake_events(self.monitor):
            if event in HANDSHAKE_FAILED:
                self.handshakes_refused += 1
                self.say("handshake", f"refused a connection to the policy link: handshake failed: {what}")

    def recv_latest(self, timeout_ms: int) -> list[tuple[bytes, Message]]:
        """Wait up to ``timeout_ms`` for messages; returns the newest valid one per sender
        (older queued observations are stale and skipped) plus every non-obs message."""
        ready = dict(self._poller.poll(timeout_ms))
        if self.monitor in ready:
            self._note_handshakes()
        if self.sock not in ready:
            return []
        latest: dict[bytes, Message] = {}
        others: list[tuple[bytes, Message]] = []
        now = time.monotonic()
        more = True  # the poll said a message waits; then EVENTS says whether another does
        while more:  # (cheaper than the zmq.Again exception a non-blocking recv raises at the end)
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)  # copying a few frames beats Frame objects
            except zmq.Again:
                break
            more = bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
            ident = frames[0]
            try:
                msg = decode(frames[1:], None, self.limits)
            except MessageError as exc:
                self._reject(str(exc).split(":")[0][:60], str(exc))
                continue
            if msg.kind == "obs":
                if self._fresh(ident, msg, now):
                    latest[ident] = msg
            else:
                others.append((ident, msg))
        return others + list(latest.items())

    def send(self, ident: bytes, msg: Message) -> None:
        self.sock.send_multipart([ident, *encode(msg)])  # copy: zero-copy sends wake pyzmq's gc thread

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
        if self.auth is not None:
            self.auth.stop()
        if self._own_ctx:
            self.ctx.term()


class PolicyClient:
    """Node side: non-blocking send of observations, non-blocking receive of replies."""

    def __init__(self, endpoint: str, key: bytes | None = None, limits: Limits = Limits(),
                 context: zmq.Context | None = None, insecure_loopback: bool = False,
                 refused_after: int = 1, encrypt: bool | None = None):
        check_bind(endpoint, key, insecure_loopback)
        self.mechanism = mechanism(endpoint, key, encrypt)
        self.key, self.limits = key, limits
        self.ctx = context or zmq.Context.instance()
        self.sock = _socket(self.ctx, zmq.DEALER, limits)
        self.sock.setsockopt(zmq.SNDHWM, 4)
        self.sock.setsockopt(zmq.RCVHWM, 16)
        # a stable identity: a reconnect (worker restart, network blip) is the same session
        self.sock.setsockopt(zmq.ROUTING_ID, b"rp-" + os.urandom(12))
        if self.mechanism == "curve":
            _check_curve()
            self.sock.curve_serverkey = curve_keys(key, "server")[0]
            self.sock.curve_publickey, self.sock.curve_secretkey = curve_keys(key, "client")
        elif self.mechanism == "plain":
            self.sock.plain_username = b"robopolicy"
            self.sock.plain_password = plain_token(key)
        self.monitor = self.sock.get_monitor_socket(
            sum(HANDSHAKE_FAILED) | EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._in_handshake = False  # connected, handshake not yet succeeded
        self.sock.connect(endpoint)
        self.endpoint = endpoint
        self.refused_after = int(refused_after)
        self.handshakes_ok = self.handshakes_failed = 0
        self.last_handshake_error = ""
        self.rejected: Counter[str] = Counter()
        self.last_reject = ""
        self.send_dropped = 0
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._next_monitor_check = 0.0

    def wait(self, timeout_ms: int) -> bool:
        """Block up to ``timeout_ms`` for a reply (for callers outside a control loop)."""
        return bool(self._poller.poll(timeout_ms))

    def send(self, msg: Message) -> bool:
        """Queue ``msg``; False (and counted) when the queue is full: never blocks the loop."""
        try:
            self.sock.send_multipart(encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.send_dropped += 1
            return False

    def poll(self) -> list[Message]:
        """Every valid reply received so far (never blocks); invalid ones are counted, dropped."""
        out = []
        while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # no zmq.Again exception per empty call
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(decode(frames, None, self.limits))
            except MessageError as exc:
                self.rejected[str(exc).split(":")[0][:60]] += 1
                self.last_reject = str(exc)
        return out

    def handshake_problem(self) -> str | None:
        """Why the worker refuses this node's handshake (wrong key, no key, a keyed peer where
        none is expected), once it failed ``refused_after`` times in a row with no success; else None.
        Cheap to call every tick: the monitor is read at most every 20 ms."""
        now = time.monotonic()
        if now < self._next_monitor_check:
            return self._refusal()
        self._next_monitor_check = now + 0.02
        for event, what in _drain_handshake_events(self.monitor):
            if event == zmq.EVENT_CONNECTED:
                self._in_handshake = True
            elif event == EVENT_HANDSHAKE_SUCCEEDED:
                self._in_handshake = False
                self.handshakes_ok += 1
                self.handshakes_failed = 0
            elif event in HANDSHAKE_FAILED or (event == zmq.EVENT_DISCONNECTED and self._in_handshake):
                # a keyed worker drops a keyless node without telling it why: a disconnect
                # before the handshake succeeded is a refusal too
                self._in_handshake = False
                self.handshakes_failed += 1
                self.last_handshake_error = what if event in HANDSHAKE_FAILED else "closed during the handshake"
        return self._refusal()

    def _refusal(self) -> str | None:
        if self.handshakes_failed >= self.refused_after:
            return (f"the policy worker at {self.endpoint} refused the handshake ({self.handshakes_failed}x, "
                    f"{self.last_handshake_error}): check the auth key (and encrypt) on both ends")
        return None

    def stats(self) -> dict[str, Any]:
        return {"rejected": sum(self.rejected.values()), "last_reject": self.last_reject,
                "send_dropped": self.send_dropped, "handshakes": self.handshakes_ok,
                "handshakes_failed": self.handshakes_failed}

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
