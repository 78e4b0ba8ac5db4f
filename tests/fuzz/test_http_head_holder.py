"""Issue 23: each answer leaves in one write (head and body together: one send, one TLS record), and nothing
is held back that a client waits for: ``100 Continue``, a HEAD answer's head, a closing connection's last
bytes."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kubegpu.httpserve import BoundedServer, ServeLimits, _HeadHolder, config
from kubegpu.scheduler.app import Extender
from kubegpu.scheduler.state import ClusterView


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class Cycle:
    def __init__(self, method: str = "POST") -> None:
        self.response_started = False
        self.scope = {"method": method}


def test_head_waits_for_the_body_and_nothing_else_waits() -> None:
    t, c = Transport(), Cycle()
    h = _HeadHolder(t, c)  # type: ignore[arg-type]
    h.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # before the response starts: at once
    assert t.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    c.response_started = True
    h.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    assert len(t.writes) == 1
    h.write(b"{}")
    assert t.writes[1] == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
    assert not h.is_closing()  # the rest is the transport's


@pytest.mark.parametrize("method", ["HEAD", "POST"])
def test_a_head_without_body_still_leaves(method: str) -> None:
    t, c = Transport(), Cycle(method)
    h = _HeadHolder(t, c)  # type: ignore[arg-type]
    c.response_started = True
    h.write(b"HTTP/1.1 500 Internal Server Error\r\n\r\n")
    h.close()  # uvicorn closes a connection whose app failed after starting the answer
    assert t.writes == [b"HTTP/1.1 500 Internal Server Error\r\n\r\n"] and t.closed


@pytest.fixture()
def port() -> Iterator[int]:
    server = BoundedServer(config(Extender(ClusterView(), None).app, ServeLimits(), host="127.0.0.1", port=0))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(10)


def exchange(port: int, request: bytes, until: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        out = b""
        while until not in out:
            chunk: Any = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def test_answers_over_a_real_socket(port: int) -> None:
    assert b"200 OK" in exchange(port, b"HEAD /healthz HTTP/1.1\r\nhost: x\r\n\r\n", b"\r\n\r\n")
    got = exchange(port, b"POST /filter HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n",
                   b"100 Continue")
    assert got.startswith(b"HTTP/1.1 100 Continue")
    body = b'{"Pod": {}, "NodeNames": ["a"]}'
    got = exchange(port, b"POST /filter HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body),
                   b'"Error":""}')
    assert got.startswith(b"HTTP/1.1 200 OK") and b'"FailedAndUnresolvableNodes":{"a":' in got
