"""Typed messages between the control node and the policy worker over ZeroMQ.

Each message is multipart: a msgpack header (a map of plain values) and one raw frame per array.
Everything is checked against a schema with size limits before use; nothing received is ever
unpickled (msgpack extension types are refused). With a shared key the link authenticates peers
when they connect (ZeroMQ CURVE + a ZAP handler, see :mod:`hardware.transport.zmq_link`).
"""

from hardware.transport.messages import Limits, Message, MessageError, decode, encode
from hardware.transport.zmq_link import PolicyClient, PolicyServer, TransportError, check_bind, curve_keys

__all__ = [
    "Limits", "Message", "MessageError", "PolicyClient", "PolicyServer", "TransportError",
    "check_bind", "curve_keys", "decode", "encode",
]
