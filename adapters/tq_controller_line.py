"""A line to TransferQueue's controller whose requests are sent and answered in the calling thread.

TransferQueue's client (TQ 0.1.11) sends every controller request from its
own event-loop thread: the caller hands a coroutine over, the loop wakes,
leases a socket, sends, awaits the reply and wakes the caller. Those hand-overs
cost about 0.3 ms a request on a 2-core machine, beside the controller's own
0.7-1.3 ms. :class:`ControllerLine` sends the same messages (TQ's own
``ZMQMessage``, so its encoding and its controller's handlers) over a ZMQ DEALER
socket that belongs to the calling thread, and reads the reply there. A caller
can send several requests before reading their replies (a put's key lookup goes
out before its columns are staged; its tags and its notice go out together),
and the controller, which serves its requests one at a time, answers them in
the order they were sent.

Invariant: a socket's replies are read in the order of its requests, and a
socket carries a new :meth:`ControllerLine.exchange` only after every request
of the one before it was answered. An exchange that ends with a reply unread
(an error, a deadline, an interrupt) closes its socket, so a late reply never
answers another request.

No TQ state is kept here: keys, partitions, tags and production status stay
the controller's, and every request is one TQ knows.

Framing: TQ's own ``ZMQMessage.serialize`` encodes with msgpack, and its
decoder then walks the whole decoded body in Python (``_reconstruct_special_types``
visits every dict, list and item, to find TensorDicts): for a put's 256 keys
and their tags, the largest part of what the controller spends on the request.
The requests in :data:`PICKLED` carry only values the adapter builds (``str``,
``int``, ``bool``, ``None``, lists and dicts of them, no tuples; torch dtypes,
which both framings pickle), on which both framings decode to equal bodies, so
they go out in TQ's other framing, its pickle fallback
(``_PICKLE_FALLBACK_SENTINEL`` then one pickle), which the controller decodes
with one ``pickle.loads`` and no walk. Every other request goes out as TQ
frames it.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import zmq
from transfer_queue.utils.serial_utils import _PICKLE_FALLBACK_SENTINEL
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

__all__ = ["PICKLED", "ControllerLine", "Exchange", "Wait", "frame_request"]

Wait = Callable[[Callable[[float], tuple[bool, Any]]], Any]
"""How an exchange waits for a reply: called with ``poll`` (waits at most the seconds it is given; returns ``(True,
reply)`` or ``(False, None)``), returns the reply; :func:`adapters.store_health.wait_for` with a call's deadlines."""

PORT = "request_handle_socket"
"""The controller's port that serves requests (TQ's own clients use it too)."""

PICKLED = frozenset({
    ZMQRequestType.KV_RETRIEVE_META,
    ZMQRequestType.SET_CUSTOM_META,
    ZMQRequestType.NOTIFY_DATA_UPDATE,
    ZMQRequestType.CLEAR_META,
})
"""The requests sent in TQ's pickle framing (see the module's docstring): a key lookup (keys, a partition, a flag), the
keys' tags (global index -> the key's tags, which the adapter thaws: :func:`core.frozen.thaw` turns tuples into lists),
the notice that a put's fields are produced (global indexes and each field's schema, its shape a list:
:func:`adapters.tq_object_store.field_schema`) and a clear (global indexes and partitions).
``tests/e2e/test_tq_object_store.py`` checks that every such request the adapter sends decodes to the same body, type
for type, in either framing."""


def frame_request(message: ZMQMessage) -> list[Any]:
    """The frames of ``message`` as the controller receives them: TQ's pickle framing for a request in
    :data:`PICKLED`, TQ's own ``serialize`` for any other; ``ZMQMessage.deserialize`` reads either."""
    if message.request_type not in PICKLED:
        return message.serialize()
    fields = {
        "request_type": message.request_type.value,
        "sender_id": message.sender_id,
        "receiver_id": message.receiver_id,
        "request_id": message.request_id,
        "timestamp": message.timestamp,
        "body": message.body,
    }
    return [_PICKLE_FALLBACK_SENTINEL, pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL)]


class ControllerLine:
    """Requests to one TQ controller, each thread on a DEALER socket of its own.

    Args:
        controller: the controller's ``ZMQServerInfo`` (TQ's client holds it as ``_controller``).
        sender_id: the name the requests are sent under (the controller logs it).

    Example:
        >>> line = ControllerLine(tq_system.client()._controller, "store")  # doctest: +SKIP
        >>> with line.exchange(wait) as exchange:  # doctest: +SKIP
        ...     exchange.send(ZMQRequestType.KV_LIST, {"partition_id": "train"})
        ...     listed = exchange.receive(ZMQRequestType.KV_LIST_RESPONSE)
    """

    def __init__(self, controller: Any, sender_id: str) -> None:
        self._controller_id = controller.id
        self._address = controller.to_addr(PORT)
        self._sender_id = sender_id
        self._local = threading.local()
        self._count = itertools.count()
        self._lock = threading.Lock()
        self._closers: list[weakref.finalize] = []  # one per socket; called (once) when its thread ends, or at close
        self._closed = False
        # A line dropped without close() (its store never closed) still closes its sockets.
        weakref.finalize(self, _close_all, self._closers, self._lock)

    @contextlib.contextmanager
    def exchange(self, wait: Wait) -> Iterator[Exchange]:
        """The calling thread's socket for one call's requests; closed at the end if any reply is left unread.

        Raises:
            RuntimeError: the line is closed.
        """
        held = self._held()
        exchange = Exchange(held.socket, self._controller_id, self._sender_id, wait)
        try:
            yield exchange
        finally:
            if exchange.unanswered:
                self._local.held = None
                held.closer()

    def open_sockets(self) -> int:
        """How many sockets are open: one per thread that has made an exchange and not ended since."""
        with self._lock:
            return sum(closer.alive for closer in self._closers)

    def close(self) -> None:
        """Close every thread's socket; idempotent. An exchange after it raises ``RuntimeError``."""
        with self._lock:
            self._closed = True
        _close_all(self._closers, self._lock)

    def _held(self) -> _Held:
        held = getattr(self._local, "held", None)
        if held is not None and held.closer.alive:
            return held
        with self._lock:
            if self._closed:
                raise RuntimeError("the controller line is closed")
            # The process's one context (pyzmq makes a forked child its own); it is never terminated here.
            socket = zmq.Context.instance().socket(zmq.DEALER)
            held = _Held(socket)
            self._closers[:] = [closer for closer in self._closers if closer.alive] + [held.closer]
        # The controller's ROUTER routes replies by identity and drops a second peer with one it knows.
        socket.setsockopt(zmq.IDENTITY, f"{self._sender_id}_line_{uuid.uuid4().hex[:8]}_{next(self._count)}".encode())
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self._address)
        self._local.held = held
        return held


class _Held:
    """A thread's socket, held by that thread alone: when the thread ends, its locals go and the socket is closed."""

    __slots__ = ("socket", "closer", "__weakref__")

    def __init__(self, socket: zmq.Socket[Any]) -> None:
        self.socket = socket
        self.closer = weakref.finalize(self, socket.close, 0)


def _close_all(closers: list[weakref.finalize], lock: threading.Lock) -> None:
    with lock:
        closing = list(closers)
        closers.clear()
    for closer in closing:
        closer()


class Exchange:
    """One call's requests on a thread's socket: :meth:`send` now, :meth:`receive` the replies later, in order."""

    def __init__(self, socket: zmq.Socket[Any], controller_id: str, sender_id: str, wait: Wait) -> None:
        self._socket = socket
        self._controller_id = controller_id
        self._sender_id = sender_id
        self._wait = wait
        self._sent: list[ZMQRequestType] = []

    @property
    def unanswered(self) -> int:
        """Requests sent whose replies are not read yet."""
        return len(self._sent)

    def send(self, request_type: ZMQRequestType, body: dict[str, Any]) -> None:
        """Send one request (TQ's message of ``request_type`` with ``body``); its reply is read by :meth:`receive`."""
        message = ZMQMessage.create(
            request_type=request_type, sender_id=self._sender_id, receiver_id=self._controller_id, body=body
        )
        frames = frame_request(message)
        self._sent.append(request_type)
        self._socket.send_multipart(frames, copy=False)

    def receive(self, response_type: ZMQRequestType) -> dict[str, Any]:
        """The body of the reply to the oldest request not yet answered, waited for with the exchange's ``wait``.

        Raises:
            RuntimeError: no request is waiting for a reply; or the controller answered with another type (its
                error reply, whose message is quoted, when the request failed there).
        """
        if not self._sent:
            raise RuntimeError(f"no request waits for a reply: expected {response_type.value}")

        def poll(timeout: float) -> tuple[bool, Any]:
            if not self._socket.poll(int(timeout * 1000), zmq.POLLIN):
                return False, None
            return True, ZMQMessage.deserialize(self._socket.recv_multipart(copy=False))

        reply = self._wait(poll)
        request = self._sent.pop(0)
        if reply.request_type != response_type:
            message = reply.body.get("message", reply.body) if isinstance(reply.body, dict) else reply.body
            raise RuntimeError(
                f"TransferQueue's controller answered {request.value} with {reply.request_type.value}, expected "
                f"{response_type.value}: {message}"
            )
        return reply.body
