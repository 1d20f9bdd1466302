"""Typed messages between the control node and the policy worker over ZeroMQ.

Each message is multipart: a msgpack header (a map of plain values), one raw frame per array,
and, when a key is configured, an HMAC-SHA256 tag. Everything is checked against a schema with
size limits before use; nothing received is ever unpickled (msgpack extension types are refused).
"""

from hardware.transport.messages import Limits, Message, MessageError, decode, encode
from hardware.transport.zmq_link import PolicyClient, PolicyServer, TransportError, check_bind

__all__ = [
    "Limits", "Message", "MessageError", "PolicyClient", "PolicyServer", "TransportError",
    "check_bind", "decode", "encode",
]
