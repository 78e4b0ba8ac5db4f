"""The node daemon's gRPC runtime: grpclib servers and clients on one asyncio loop, for a daemon of threads.

Why grpclib and not grpcio: the node daemon runs on every GPU node and must stay small. grpcio's C core is
resident code the daemon pays for whatever it does, plus the allocations and threads of its completion
queues; grpclib speaks the same HTTP/2 through ``h2`` in pure Python, at a small cost per call that keeps
``Allocate`` well within its latency target (docs/performance.md, "The node daemon", has the numbers).

Why one loop in a thread. The rest of the daemon is threads and blocking calls (health, the publishers,
the handoff resolver and its reads of the API server and of the kubelet's PodResources, the
lifecycle). Every server and client of the process runs on one event loop in one daemon thread, and
threads reach it through :func:`call`. The loop itself never blocks:

- :func:`answer` runs a unary handler on the loop when it never blocks (its answer costs less than the hop
  to a thread and back would) and in a worker thread when it may wait;
- :func:`stream_out` runs a server stream's generator in its own thread, as long-lived streams that
  wait on threading conditions need;
- so no handler on the loop thread ever waits on the loop, which :func:`call` refuses outright.

Requests are bounded as grpcio and grpc-go bound them (4 MiB): grpclib would otherwise buffer whatever
length a message header claims before decoding it.

Streams are bounded per server, not per connection. h2 advertises at most 100 concurrent streams per
connection, so a client with 100 idle streams open (a grpcio client counts a stream the server ended
until it reads the end) has every later call on that connection wait for a slot that never comes: the
kubelet's ``Allocate`` would time out behind streams it left open. Each connection may open
MAX_CONCURRENT_STREAMS; what a stream costs here (its generator's thread) is bounded by
MAX_OPEN_STREAMS per server, past which the oldest stream ends (the kubelet's live stream is its newest).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import os
import struct
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from grpclib.client import Channel
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.protocol import Connection, H2Protocol
from grpclib.server import Server, Stream
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.frame import GoAwayFrame

log = logging.getLogger(__name__)

T = TypeVar("T")
Req = TypeVar("Req")
Resp = TypeVar("Resp")

MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # grpcio's and grpc-go's default receive limit
# A stream's messages yielded but not yet sent. A client that stops reading (HTTP/2 flow control then
# holds the sends) stops its generator after this many instead of letting them pile up: the generators
# here yield whole snapshots, so the one yielded after the wait is the newest state, not a stale one.
MAX_UNSENT_MESSAGES = 4
# Calls and streams one connection may have open at once (h2's own default, 100, lets idle streams starve the
# connection's calls). grpc-go and grpcio servers set no limit; this one still bounds a connection's queued calls.
MAX_CONCURRENT_STREAMS = 1024
# Server-streaming calls one server keeps open (each holds its generator's thread). The kubelet holds one per
# socket; a newer stream ends the oldest past this, so leftovers of a restarted client cannot lock it out.
MAX_OPEN_STREAMS = 128

__all__ = [
    "MAX_CONCURRENT_STREAMS",
    "MAX_MESSAGE_BYTES",
    "MAX_OPEN_STREAMS",
    "MAX_UNSENT_MESSAGES",
    "CallFailed",
    "RpcAbort",
    "Status",
    "StreamContext",
    "UnixServer",
    "answer",
    "call",
    "stream_out",
    "unix_call",
]


class RpcAbort(Exception):
    """Raised by a handler to answer with a gRPC status instead of a message."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class CallFailed(Exception):
    """A client call got no answer: ``status`` is the server's, or UNAVAILABLE / DEADLINE_EXCEEDED."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# ----- the loop ------------------------------------------------------------------------------------

class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), name="grpc-loop", daemon=True)
        self.thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(ready.set)
        self.loop.run_forever()


_lock = threading.Lock()
_current: _LoopThread | None = None


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's gRPC loop, started on first use (and again in a forked child)."""
    global _current
    with _lock:
        if _current is None or _current.pid != os.getpid():
            _current = _LoopThread()
        return _current.loop


def call(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """Run ``coro`` on the gRPC loop from another thread and wait at most ``timeout_s`` for its result."""
    loop = event_loop()
    if _current is not None and threading.current_thread() is _current.thread:
        coro.close()
        raise RuntimeError("rpc.call() from the gRPC loop's own thread would wait on itself")
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return fut.result(timeout_s)
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise CallFailed(Status.DEADLINE_EXCEEDED, f"no answer within {timeout_s:g}s") from None


# ----- clients -------------------------------------------------------------------------------------

def unix_call(path: str | os.PathLike[str], method: Callable[[Channel], Coroutine[Any, Any, T]],
              timeout_s: float) -> T:
    """One call over a fresh connection to the unix socket ``path``, from a thread; ``method`` makes
    the call on the channel it is given (``lambda ch: Stub(ch).Register(req)``). Raises
    :class:`CallFailed` for the server's error status, a refused or missing socket, or a timeout."""

    async def run() -> T:
        channel = Channel(path=str(path))
        # grpclib would send ":authority: None:None" for a socket path, which strict HTTP/2 servers refuse as
        # malformed; grpc-go (the kubelet) and grpcio send "localhost" for a unix socket.
        channel._authority = "localhost"
        try:
            return await asyncio.wait_for(method(channel), timeout_s)
        except GRPCError as exc:
            raise CallFailed(exc.status, exc.message or exc.status.name) from None
        except (OSError, StreamTerminatedError) as exc:
            raise CallFailed(Status.UNAVAILABLE, f"{path}: {exc}") from None
        except TimeoutError:
            raise CallFailed(Status.DEADLINE_EXCEEDED, f"{path}: no answer within {timeout_s:g}s") from None
        finally:
            channel.close()

    return call(run(), timeout_s + 1.0)


# ----- servers -------------------------------------------------------------------------------------

async def receive(stream: Stream[Req, Any]) -> Req:
    """The request of a unary-request call, refused if its header claims more than MAX_MESSAGE_BYTES."""
    # grpclib reads a message whole before decoding it, trusting the length in its 5-byte header; read
    # the header first (through its protocol stream, the one place it is reachable) to bound it.
    raw = stream._stream
    meta = await raw.recv_data(5)
    if len(meta) < 5:
        raise GRPCError(Status.INVALID_ARGUMENT, "the request has no message")
    compressed, length = struct.unpack(">?I", meta)
    if compressed:
        raise GRPCError(Status.UNIMPLEMENTED, "compressed requests are not supported")
    if length > MAX_MESSAGE_BYTES:
        raise GRPCError(Status.RESOURCE_EXHAUSTED,
                        f"request of {length} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    body = await raw.recv_data(length)
    try:
        return stream._codec.decode(body, stream._recv_type)  # type: ignore[no-any-return]
    except Exception as exc:  # grpcio's and grpc-go's answer to bytes that are not the message, unlogged
        raise GRPCError(Status.INTERNAL, f"the request could not be decoded: {exc}") from None


async def answer(stream: Stream[Req, Resp], handler: Callable[[Req], Resp], *,
                 executor: concurrent.futures.Executor | None = None) -> None:
    """Serve one unary call: ``handler(request)`` on the loop, or in ``executor`` when it may block.
    :class:`RpcAbort` becomes the call's status; any other exception is logged and answered INTERNAL."""
    request = await receive(stream)
    try:
        if executor is None:
            response = handler(request)
        else:
            response = await asyncio.get_running_loop().run_in_executor(executor, handler, request)
    except RpcAbort as exc:
        raise GRPCError(exc.status, exc.message) from None
    except Exception as exc:
        log.exception("%s failed", getattr(handler, "__name__", "handler"))
        raise GRPCError(Status.INTERNAL, f"internal error: {exc}") from None
    await stream.send_message(response)


class StreamContext:
    """What a streaming generator sees of its call: whether the client is still there; ``on_cancel``
    hooks, run on the loop the moment the call ends so that a generator waiting for its next message
    wakes (they must not block); and callbacks run once the stream has ended for any reason (client
    gone, server stopping, generator done), in the stream's own thread after its generator returned:
    never on the loop, so they may block or make calls."""

    def __init__(self) -> None:
        self._active = threading.Event()
        self._active.set()
        self._callbacks: list[Callable[[], None]] = []
        self._wakers: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.ended_by_server = ""  # why the server ended the call (its status message), or ""

    def is_active(self) -> bool:
        return self._active.is_set()

    def add_callback(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def on_cancel(self, wake: Callable[[], None]) -> None:
        with self._lock:
            if self._active.is_set():
                self._wakers.append(wake)
                return
        wake()  # already over: wake at once

    def cancel(self) -> None:
        with self._lock:
            self._active.clear()
            wakers, self._wakers = self._wakers, []
        _run_all(wakers, "stream cancel hook")

    def run_callbacks(self) -> None:
        with self._lock:
            self._active.clear()
            callbacks, self._callbacks = self._callbacks, []
        _run_all(callbacks, "stream end callback")


class _OpenStreams:
    """The server-streaming calls one server has open, oldest first. Touched only on the loop."""

    def __init__(self) -> None:
        self._open: dict[StreamContext, None] = {}  # insertion-ordered: the oldest first

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, context: StreamContext) -> None:
        self._open[context] = None
        while len(self._open) > MAX_OPEN_STREAMS:
            oldest = next(iter(self._open))
            del self._open[oldest]
            oldest.ended_by_server = (f"more than {MAX_OPEN_STREAMS} streams open on this socket: "
                                      "the oldest was ended")
            oldest.cancel()

    def leave(self, context: StreamContext) -> None:
        self._open.pop(context, None)


# The open streams of the server whose handler runs in this task (set by UnixServer for its streams).
_server_streams: contextvars.ContextVar[_OpenStreams | None] = contextvars.ContextVar(
    "kubegpu_rpc_server_streams", default=None)


def _run_all(callbacks: list[Callable[[], None]], what: str) -> None:
    for cb in callbacks:
        try:
            cb()
        except Exception:
            log.exception("%s failed", what)


async def stream_out(stream: Stream[Req, Resp], generate: Callable[[Req, StreamContext], Iterable[Resp]],
                     name: str) -> None:
    """Serve a server-streaming call: ``generate(request, context)`` runs in a thread of its own (it
    may wait on threading conditions between messages) and each message it yields is sent in order.
    The generator sees ``context.is_active()`` turn false once the client is gone (or the server ended the
    call: past MAX_OPEN_STREAMS on a :class:`UnixServer`), and waits at its ``yield`` while
    MAX_UNSENT_MESSAGES of its messages are still unsent."""
    request = await receive(stream)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
    context = StreamContext()
    unsent = threading.BoundedSemaphore(MAX_UNSENT_MESSAGES)
    # Ending the call wakes a generator waiting for room; it then sees the call over and stops.
    context.on_cancel(lambda: _release(unsent))
    open_streams = _server_streams.get()
    if open_streams is not None:
        open_streams.admit(context)

    def produce() -> None:
        try:
            for message in generate(request, context):
                unsent.acquire()
                if not context.is_active():
                    break
                loop.call_soon_threadsafe(queue.put_nowait, (True, message))
        except Exception as exc:
            log.exception("%s: stream failed", name)
            loop.call_soon_threadsafe(queue.put_nowait, (False, exc))
            return
        finally:
            context.run_callbacks()
        loop.call_soon_threadsafe(queue.put_nowait, (False, None))

    producer = threading.Thread(target=produce, name=name, daemon=True)
    producer.start()
    try:
        while True:
            more, item = await queue.get()
            if not more:
                if item is not None:
                    raise GRPCError(Status.INTERNAL, f"internal error: {item}")
                if context.ended_by_server:
                    raise GRPCError(Status.RESOURCE_EXHAUSTED, context.ended_by_server)
                return
            await stream.send_message(item)
            unsent.release()
    finally:
        if open_streams is not None:
            open_streams.leave(context)
        context.cancel()  # the client left, the server stops, or the generator ended: the thread ends too


def _release(unsent: threading.BoundedSemaphore) -> None:
    # The call's end releases one more than was taken when no message was waiting: that one is moot.
    with contextlib.suppress(ValueError):
        unsent.release()


class UnixServer:
    """One grpclib server on one unix socket. ``stop(grace_s)`` stops as grpc-go's and grpcio's graceful
    stop do: clients are told at once that calls they open from then on are not served here (they retry
    them elsewhere), unary calls in flight get up to ``grace_s`` to finish, streams end at once, the
    connections close, and the socket is removed if it is still the one bound."""

    def __init__(self, services: Iterable[Any], path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._services = list(services)
        self._server: Server | None = None
        self._inode: int | None = None
        self._in_flight = 0
        self._idle: asyncio.Event | None = None
        self._streams = _OpenStreams()
        self._connections: weakref.WeakSet[H2Protocol] = weakref.WeakSet()
        # While stopping: each connection's last call that is served (the one its GOAWAY names).
        self._last_served: weakref.WeakKeyDictionary[Connection, int] | None = None

    @property
    def serving(self) -> bool:
        """Between start() and stop()."""
        return self._server is not None

    def start(self, timeout_s: float = 5.0) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

        self._last_served = None

        async def start() -> Server:
            server = Server([_Tracked(service, self) for service in self._services])
            server._protocol_factory = self._counting(server._protocol_factory)  # type: ignore[method-assign]
            await server.start(path=str(self.path))
            return server

        self._server = call(start(), timeout_s)
        try:
            self._inode = self.path.stat().st_ino
        except FileNotFoundError:
            self._inode = None

    def intact(self) -> bool:
        """The socket file still exists and is the one this server bound (a kubelet restart deletes it)."""
        try:
            return self._inode is not None and self.path.stat().st_ino == self._inode
        except FileNotFoundError:
            return False

    @property
    def open_streams(self) -> int:
        """Server-streaming calls open now (at most MAX_OPEN_STREAMS)."""
        return len(self._streams)

    def track(self, func: Callable[[Stream[Any, Any]], Coroutine[Any, Any, None]], *, streaming: bool = False
              ) -> Callable[[Stream[Any, Any]], Coroutine[Any, Any, None]]:
        """``func`` refused once stop() began; a unary handler is counted while it runs, so that stop() can
        wait for it, and a streaming one counts among this server's open streams (:func:`stream_out`)."""

        async def tracked(stream: Stream[Any, Any]) -> None:
            if self._refused(stream):
                # Opened after the GOAWAY: the client takes REFUSED_STREAM for "not processed" and retries.
                stream._stream.reset_nowait(ErrorCodes.REFUSED_STREAM)
                stream._cancel_done = True  # grpclib sends nothing more on a stream it cancelled
                return
            if streaming:
                _server_streams.set(self._streams)  # this call's task only: each call runs in a task of its own
                await func(stream)
                return
            self._in_flight += 1
            try:
                await func(stream)
            finally:
                self._in_flight -= 1
                if self._in_flight == 0 and self._idle is not None:
                    self._idle.set()

        return tracked

    def _counting(self, factory: Callable[[], H2Protocol]) -> Callable[[], H2Protocol]:
        """grpclib's connection factory, each connection remembered so that stop() can close it and allowed
        MAX_CONCURRENT_STREAMS."""

        def make() -> H2Protocol:
            made = factory()
            protocol = _Protocol(made.handler, made.config, made.h2_config)
            self._connections.add(protocol)
            return protocol

        return make

    def _open_connections(self) -> Iterator[Connection]:
        for protocol in list(self._connections):
            connection = getattr(protocol, "connection", None)  # absent before the connection is made
            if connection is not None and not connection.is_closing():
                yield connection

    def _refused(self, stream: Stream[Any, Any]) -> bool:
        last, sid = self._last_served, stream._stream.id
        return last is not None and sid is not None and sid > last.get(stream._stream.connection, 0)

    def _announce_stop(self, server: Server) -> None:
        """No new connections, and a GOAWAY on each open one naming the last call received: the calls
        before it are served (or get the grace), the client opens no more here and retries any later one."""
        if server._server is not None:
            server._server.close()  # the listening socket only: connections and their calls go on
        last: weakref.WeakKeyDictionary[Connection, int] = weakref.WeakKeyDictionary()
        for connection in self._open_connections():
            last[connection] = connection._connection.highest_inbound_stream_id
            connection.flush()
            # Written past h2, which takes its own GOAWAY for the connection's end and then refuses to send
            # the answers still due; a second GOAWAY, with the same last call, comes as it closes.
            connection._transport.write(GoAwayFrame(0, last_stream_id=last[connection]).serialize())
        self._last_served = last

    def _close_connections(self) -> None:
        """GOAWAY and close every connection still open. grpclib's close() cancels the calls but leaves
        their connections open, and a client (the kubelet) would wait on a stream that never ends; grpcio
        and grpc-go close them, and the kubelet takes the stream's end for the plugin's."""
        last: weakref.WeakKeyDictionary[Connection, int] = self._last_served or weakref.WeakKeyDictionary()
        for connection in self._open_connections():
            with contextlib.suppress(Exception):  # a connection breaking as it closes is closed
                h2c = connection._connection
                h2c.close_connection(last_stream_id=last.get(connection, h2c.highest_inbound_stream_id))
                connection.flush()
            connection.close()

    def stop(self, grace_s: float | None = 0.0) -> None:
        server, self._server = self._server, None
        if server is not None:
            grace = grace_s or 0.0

            async def stop() -> None:
                self._announce_stop(server)
                if self._in_flight and grace > 0:
                    self._idle = asyncio.Event()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._idle.wait(), grace)
                    self._idle = None
                server.close()
                await server.wait_closed()
                self._close_connections()

            try:
                call(stop(), grace + 5.0)
            except CallFailed:
                log.warning("gRPC server on %s did not close within %.0fs", self.path, grace + 5.0)
        if self.intact():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self._inode = None


class _Protocol(H2Protocol):
    """grpclib's connection, with its stream limit raised from h2's 100 to MAX_CONCURRENT_STREAMS."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # Sent right behind the connection's first SETTINGS, before the client's first call is read.
        self.connection._connection.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS})
        self.connection.flush()


class _Tracked:
    """A service whose handlers its :class:`UnixServer` tracks (:meth:`UnixServer.track`)."""

    def __init__(self, service: Any, server: UnixServer) -> None:
        self._mapping: dict[str, Handler] = {
            name: h._replace(func=server.track(h.func, streaming=h.cardinality is Cardinality.UNARY_STREAM))
            if h.cardinality in (Cardinality.UNARY_UNARY, Cardinality.UNARY_STREAM) else h
            for name, h in service.__mapping__().items()}

    def __mapping__(self) -> dict[str, Handler]:
        return self._mapping
