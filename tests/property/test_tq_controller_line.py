"""Laws of ``adapters.tq_controller_line``: replies in request order, and no reply outlives its exchange.

The controller here is a stand-in: a ZMQ ROUTER in a thread that answers each
request (TransferQueue's own ``ZMQMessage``) with the request's ``n`` echoed,
after the delay the request asks for; a request with ``"refuse"`` is answered
with TQ's error reply. The real controller is exercised through the store in
``tests/e2e/test_transfer_queue.py`` and ``tests/e2e/test_tq_object_store.py``.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from transfer_queue.utils.enum_utils import Role
from transfer_queue.utils.serial_utils import _PICKLE_FALLBACK_SENTINEL
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType, ZMQServerInfo

from adapters.tq_controller_line import PICKLED, PORT, ControllerLine, frame_request

ASK, ANSWER = ZMQRequestType.KV_LIST, ZMQRequestType.KV_LIST_RESPONSE


class _Controller:
    """A ROUTER that answers every request in arrival order, one at a time, as TQ's controller does."""

    def __init__(self) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.info = ZMQServerInfo(Role.CONTROLLER, "fake-controller", "127.0.0.1", {PORT: port})
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(20):
                continue
            identity, *frames = self._socket.recv_multipart(copy=False)
            request = ZMQMessage.deserialize(frames)
            time.sleep(request.body.get("delay", 0.0))
            if request.body.get("refuse"):
                reply_type, body = ZMQRequestType.REQUEST_ERROR, {"success": False, "message": "refused here"}
            else:
                reply_type, body = ANSWER, {"n": request.body["n"]}
            reply = ZMQMessage.create(request_type=reply_type, sender_id="fake-controller", receiver_id=None, body=body)
            self._socket.send_multipart([identity, *reply.serialize()])
            self.answered += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        self._context.term()


@pytest.fixture(scope="module")
def controller() -> Iterator[_Controller]:
    served = _Controller()
    yield served
    served.close()


def _wait(poll: Callable[[float], tuple[bool, Any]]) -> Any:
    """Wait for a reply as long as it takes (the store's wait adds a deadline and probes)."""
    while True:
        done, reply = poll(0.5)
        if done:
            return reply


def _ask(exchange: Any, n: int, **extra: Any) -> None:
    exchange.send(ASK, {"n": n, **extra})


_PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4) | st.integers(0, 2**20), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(request_type=st.sampled_from(sorted(ZMQRequestType, key=lambda t: t.value)), body=st.dictionaries(st.text(max_size=6), _PLAIN, max_size=4))
def test_a_framed_request_decodes_to_the_message_it_was_made_from(request_type: ZMQRequestType, body: dict) -> None:  # type: ignore[type-arg]
    """Round trip: ``ZMQMessage.deserialize(frame_request(m))`` is ``m``, in TQ's pickle framing (one frame after the
    marker) for the requests in ``PICKLED`` and in TQ's own framing for the rest."""
    message = ZMQMessage.create(request_type=request_type, sender_id="law", receiver_id="controller", body=body)
    frames = frame_request(message)
    assert ZMQMessage.deserialize(frames) == message
    assert (bytes(frames[0]) == _PICKLE_FALLBACK_SENTINEL) == (request_type in PICKLED)


@settings(max_examples=25, deadline=None)
@given(ns=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=8))
def test_replies_come_back_in_the_order_their_requests_were_sent(controller: _Controller, ns: list[int]) -> None:
    line = ControllerLine(controller.info, "law")
    with line.exchange(_wait) as exchange:
        for n in ns:
            _ask(exchange, n)
        assert exchange.unanswered == len(ns)
        assert [exchange.receive(ANSWER)["n"] for _ in ns] == ns
        assert exchange.unanswered == 0
    line.close()


@settings(max_examples=10, deadline=None)
@given(sent=st.integers(1, 4), read=st.integers(0, 3))
def test_a_reply_left_unread_never_answers_a_later_exchange(controller: _Controller, sent: int, read: int) -> None:
    """An exchange that ends (here by an error) with replies unread closes its socket: the next exchange of the
    thread has a socket of its own, and what it reads is its own reply, though the old ones arrive meanwhile."""
    read = min(read, sent - 1)
    line = ControllerLine(controller.info, "law")
    with pytest.raises(InterruptedError), line.exchange(_wait) as exchange:
        for i in range(sent):
            _ask(exchange, i, delay=0.01)
        for i in range(read):
            assert exchange.receive(ANSWER)["n"] == i
        raise InterruptedError("the call ended early")
    with line.exchange(_wait) as exchange:
        _ask(exchange, -1)
        assert exchange.receive(ANSWER)["n"] == -1
    line.close()


def test_a_socket_is_kept_across_exchanges_that_read_every_reply(controller: _Controller) -> None:
    line = ControllerLine(controller.info, "law")
    sockets = []
    for n in range(3):
        with line.exchange(_wait) as exchange:
            _ask(exchange, n)
            assert exchange.receive(ANSWER)["n"] == n
            sockets.append(exchange._socket)
    assert sockets[0] is sockets[1] is sockets[2] and not sockets[0].closed
    assert line.open_sockets() == 1
    line.close()
    assert sockets[0].closed


def test_a_reply_of_another_type_raises_naming_the_request_both_types_and_the_message(controller: _Controller) -> None:
    line = ControllerLine(controller.info, "law")
    with line.exchange(_wait) as exchange:
        _ask(exchange, 1, refuse=True)
        with pytest.raises(RuntimeError, match=r"answered KV_LIST with REQUEST_ERROR, expected KV_LIST_RESPONSE: refused here"):
            exchange.receive(ANSWER)
        _ask(exchange, 2)  # the refused request's reply was read: the socket stays in step
        assert exchange.receive(ANSWER)["n"] == 2
    line.close()


def test_receive_with_no_request_waiting_raises(controller: _Controller) -> None:
    line = ControllerLine(controller.info, "law")
    with line.exchange(_wait) as exchange, pytest.raises(RuntimeError, match=r"no request waits for a reply: expected KV_LIST_RESPONSE"):
        exchange.receive(ANSWER)
    line.close()


def test_a_wait_that_gives_up_ends_the_exchange_and_the_next_one_reads_its_own_reply(controller: _Controller) -> None:
    """The store's wait raises at its deadline (``StoreTimeout``); the late reply goes to a closed socket."""
    line = ControllerLine(controller.info, "law")

    def impatient(poll: Callable[[float], tuple[bool, Any]]) -> Any:
        done, reply = poll(0.0)
        if not done:
            raise TimeoutError("no reply at once")
        return reply

    with pytest.raises(TimeoutError), line.exchange(impatient) as exchange:
        _ask(exchange, 1, delay=0.05)
        exchange.receive(ANSWER)
    with line.exchange(_wait) as exchange:
        _ask(exchange, 2)
        assert exchange.receive(ANSWER)["n"] == 2
    line.close()


def test_each_thread_has_a_socket_of_its_own(controller: _Controller) -> None:
    line = ControllerLine(controller.info, "law")
    wrong: list[tuple[int, int]] = []

    def run(thread: int) -> None:
        for i in range(30):
            n = thread * 1000 + i
            with line.exchange(_wait) as exchange:
                _ask(exchange, n)
                _ask(exchange, -n)
                got = (exchange.receive(ANSWER)["n"], exchange.receive(ANSWER)["n"])
            if got != (n, -n):
                wrong.append(got)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    gc.collect()
    assert line.open_sockets() == 0  # each thread's socket closed when the thread ended
    line.close()


def test_sockets_stay_open_while_their_threads_live_and_close_with_the_line(controller: _Controller) -> None:
    line = ControllerLine(controller.info, "law")
    used, done = threading.Barrier(3), threading.Event()
    sockets = []

    def run() -> None:
        with line.exchange(_wait) as exchange:
            _ask(exchange, 1)
            exchange.receive(ANSWER)
            sockets.append(exchange._socket)
        used.wait()
        done.wait()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    used.wait()
    assert line.open_sockets() == 2 and not any(socket.closed for socket in sockets)
    line.close()
    assert line.open_sockets() == 0 and all(socket.closed for socket in sockets)
    done.set()
    for t in threads:
        t.join()


def test_after_close_an_exchange_raises_and_close_is_idempotent(controller: _Controller) -> None:
    line = ControllerLine(controller.info, "law")
    with line.exchange(_wait) as exchange:
        _ask(exchange, 1)
        exchange.receive(ANSWER)
    line.close()
    line.close()
    with pytest.raises(RuntimeError, match=r"the controller line is closed"), line.exchange(_wait):
        pass
