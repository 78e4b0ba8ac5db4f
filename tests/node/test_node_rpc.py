"""The node daemon's gRPC runtime (kubegpu.node.rpc), served over a real unix socket and called by grpcio,
a different gRPC implementation, as the kubelet's grpc-go is: unary calls on the loop and in a thread,
statuses, the request bound, streams that see their client leave, graceful stop, and the client side."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from polling import until

from kubegpu.node import rpc
from kubegpu.node.proto import deviceplugin_grpc as dp_grpc
from kubegpu.node.proto import deviceplugin_pb2 as pb
from kubegpu.node.proto import deviceplugin_pb2_grpc as pb_grpc


class _Plugin(dp_grpc.DevicePluginBase):
    """A device plugin whose Allocate echoes its IDs, refuses "bad", and blocks on "slow"."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(2)
        self.release = threading.Event()
        self.versions = threading.Condition()
        self.version = 0
        self.ended = threading.Event()
        self.ended_on: list[str] = []
        self.loop_threads: set[str] = set()
        self.asked: list[str] = []
        self.pad = ""  # appended to each streamed device ID: sizes the stream's messages
        self.yielded = 0
        self.one_message = False  # streams end after their first message
        self.ends = 0

    def allocate(self, req: pb.AllocateRequest) -> pb.AllocateResponse:
        self.loop_threads.add(threading.current_thread().name)
        self.asked.extend(i for c in req.container_requests for i in c.devices_ids)
        resp = pb.AllocateResponse()
        for c in req.container_requests:
            if "bad" in c.devices_ids:
                raise rpc.RpcAbort(rpc.Status.INVALID_ARGUMENT, "device bad is not known")
            if "boom" in c.devices_ids:
                raise KeyError("boom")
            if "slow" in c.devices_ids:
                self.release.wait(10)
            resp.container_responses.add().envs["IDS"] = ",".join(c.devices_ids)
        return resp

    def watch(self, req: pb.Empty, ctx: rpc.StreamContext):  # type: ignore[no-untyped-def]
        ctx.add_callback(self._stream_ended)

        def wake() -> None:
            with self.versions:
                self.versions.notify_all()

        ctx.on_cancel(wake)  # the only thing that wakes this generator when its client leaves
        seen = -1
        while ctx.is_active():
            with self.versions:
                if self.version == seen:
                    self.versions.wait()
                    continue
                seen = self.version
            self.yielded += 1
            yield pb.ListAndWatchResponse(devices=[pb.Device(ID=f"v{seen}{self.pad}", health="Healthy")])
            if self.one_message:
                return

    def _stream_ended(self) -> None:
        with self.versions:
            self.ends += 1
        self.ended_on.append(threading.current_thread().name)
        self.ended.set()

    async def GetDevicePluginOptions(self, stream) -> None:  # type: ignore[no-untyped-def]
        await rpc.answer(stream, lambda _: pb.DevicePluginOptions(get_preferred_allocation_available=True))

    async def ListAndWatch(self, stream) -> None:  # type: ignore[no-untyped-def]
        await rpc.stream_out(stream, self.watch, "test-watch")

    async def GetPreferredAllocation(self, stream) -> None:  # type: ignore[no-untyped-def]
        await rpc.answer(stream, lambda _: pb.PreferredAllocationResponse())

    async def Allocate(self, stream) -> None:  # type: ignore[no-untyped-def]
        await rpc.answer(stream, self.allocate, executor=self.pool)

    async def PreStartContainer(self, stream) -> None:  # type: ignore[no-untyped-def]
        await rpc.answer(stream, lambda _: pb.PreStartContainerResponse())


@pytest.fixture
def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    plugin = _Plugin()
    server = rpc.UnixServer([plugin], tmp_path / "dp.sock")
    server.start()
    channel = grpc.insecure_channel(f"unix://{server.path}")
    yield plugin, server, pb_grpc.DevicePluginStub(channel)
    plugin.release.set()
    channel.close()
    server.stop()


def _allocate(*ids: str) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))])


def test_unary_calls_answer_and_map_statuses(served) -> None:  # type: ignore[no-untyped-def]
    plugin, _, stub = served
    assert stub.GetDevicePluginOptions(pb.Empty(), timeout=5).get_preferred_allocation_available
    assert stub.Allocate(_allocate("a", "b"), timeout=5).container_responses[0].envs["IDS"] == "a,b"
    assert all(name != "grpc-loop" for name in plugin.loop_threads), "a handler given an executor ran on the loop"
    with pytest.raises(grpc.RpcError) as refused:
        stub.Allocate(_allocate("bad"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "device bad is not known"
    with pytest.raises(grpc.RpcError) as failed:
        stub.Allocate(_allocate("boom"), timeout=5)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "boom" in failed.value.details()
    # The server goes on answering after both.
    assert stub.Allocate(_allocate("c"), timeout=5).container_responses[0].envs["IDS"] == "c"


def test_a_request_over_the_limit_is_refused_before_it_is_read(served) -> None:  # type: ignore[no-untyped-def]
    _, _, stub = served
    huge = _allocate(*("x" * 1000 for _ in range(rpc.MAX_MESSAGE_BYTES // 1000 + 10)))
    assert huge.ByteSize() > rpc.MAX_MESSAGE_BYTES
    with pytest.raises(grpc.RpcError) as refused:
        stub.Allocate(huge, timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.Allocate(_allocate("ok"), timeout=5).container_responses[0].envs["IDS"] == "ok"


def test_a_stream_sends_each_change_and_ends_when_its_client_leaves(served) -> None:  # type: ignore[no-untyped-def]
    plugin, _, stub = served
    call = stub.ListAndWatch(pb.Empty(), timeout=10)
    assert next(call).devices[0].ID == "v0"
    with plugin.versions:
        plugin.version = 1
        plugin.versions.notify_all()
    assert next(call).devices[0].ID == "v1"
    assert not plugin.ended.is_set()
    call.cancel()
    assert plugin.ended.wait(5), "the stream's generator never saw its client leave"
    assert plugin.ended_on == ["test-watch"], "end callbacks must run in the stream's thread, never on the loop"


def test_a_client_that_stops_reading_stops_its_stream_generator(served) -> None:  # type: ignore[no-untyped-def]
    plugin, _, stub = served
    plugin.pad = "x" * 1024 * 1024  # a few messages fill what the client buffers: sends then wait
    call = stub.ListAndWatch(pb.Empty(), timeout=30)
    assert next(call).devices[0].ID.startswith("v0")
    for version in range(1, 201):  # 200 changes the client never reads
        with plugin.versions:
            plugin.version = version
            plugin.versions.notify_all()
        time.sleep(0.002)
    time.sleep(0.3)
    # Unbounded, every change became a queued 1 MB message (200 here). Bounded: what the client's window
    # and buffers took, MAX_UNSENT_MESSAGES waiting, and the one the generator holds at its yield.
    assert plugin.yielded <= 40, plugin.yielded
    assert not plugin.ended.is_set()
    # Reading again gets the newest state soon: the held-back generator resumes where the changes are.
    last = ""
    deadline = time.monotonic() + 10
    while not last.startswith("v200") and time.monotonic() < deadline:
        last = next(call).devices[0].ID
    assert last.startswith("v200x")
    call.cancel()
    assert plugin.ended.wait(5), "a generator waiting for room never saw its client leave"


def test_calls_are_answered_while_a_hundred_idle_streams_are_open(served) -> None:  # type: ignore[no-untyped-def]
    # h2 alone lets a connection hold 100 streams: with the kubelet's stale streams open, its Allocate on the
    # same connection would wait for a slot until its deadline.
    plugin, server, stub = served
    calls = [stub.ListAndWatch(pb.Empty(), timeout=60) for _ in range(100)]
    for call in calls:
        assert next(call).devices[0].ID == "v0"  # served: its generator runs in its thread, now idle
    assert server.open_streams == 100
    for i in range(5):
        assert stub.Allocate(_allocate(f"d{i}"), timeout=30).container_responses[0].envs["IDS"] == f"d{i}"
    assert not plugin.ended.is_set()
    for call in calls:
        call.cancel()
    assert until(lambda: server.open_streams == 0 and plugin.ends == 100, 10)


def test_streams_the_server_ended_and_the_client_never_read_leave_its_calls_answered(served) -> None:  # type: ignore[no-untyped-def]
    # grpcio counts a stream against the connection's limit until it reads the stream's end: a client that
    # opened 100 streams and read none (the abuse bench, a careless kubelet) would time out every later call.
    plugin, server, stub = served
    plugin.one_message = True
    calls = [stub.ListAndWatch(pb.Empty(), timeout=60) for _ in range(100)]
    assert until(lambda: plugin.ends == 100, 30), "the streams' generators did not all end"
    assert stub.Allocate(_allocate("a"), timeout=30).container_responses[0].envs["IDS"] == "a"
    assert server.open_streams == 0
    for call in calls:
        call.cancel()


def test_past_the_open_stream_bound_a_new_stream_ends_the_oldest(served, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    plugin, server, stub = served
    monkeypatch.setattr(rpc, "MAX_OPEN_STREAMS", 3)
    calls = []
    for _ in range(3):  # one after the other: the first is the oldest
        calls.append(stub.ListAndWatch(pb.Empty(), timeout=30))
        next(calls[-1])
    newest = stub.ListAndWatch(pb.Empty(), timeout=30)
    next(newest)
    with pytest.raises(grpc.RpcError) as ended:
        next(calls[0])
    assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "more than 3 streams open" in ended.value.details()
    assert until(lambda: plugin.ends == 1, 5), "the oldest stream's generator did not end"
    assert server.open_streams == 3
    # The others go on: each still gets the next change.
    with plugin.versions:
        plugin.version = 1
        plugin.versions.notify_all()
    for call in [*calls[1:], newest]:
        assert next(call).devices[0].ID == "v1"
    for call in [*calls[1:], newest]:
        call.cancel()


def test_a_waiting_stream_generator_ends_when_its_client_leaves(served) -> None:  # type: ignore[no-untyped-def]
    plugin, _, stub = served
    plugin.pad = "x" * 256 * 1024
    call = stub.ListAndWatch(pb.Empty(), timeout=30)
    next(call)
    for version in range(1, 50):
        with plugin.versions:
            plugin.version = version
            plugin.versions.notify_all()
        time.sleep(0.002)
    time.sleep(0.2)  # the generator now waits at its yield for room
    call.cancel()
    assert plugin.ended.wait(5), "a generator waiting for room never saw its client leave"


def test_stop_lets_a_call_in_flight_finish_and_removes_the_socket(served) -> None:  # type: ignore[no-untyped-def]
    plugin, server, stub = served
    result: dict[str, object] = {}

    def slow() -> None:
        try:
            result["ok"] = stub.Allocate(_allocate("slow"), timeout=10).container_responses[0].envs["IDS"]
        except grpc.RpcError as exc:
            result["error"] = exc.code()

    caller = threading.Thread(target=slow)
    caller.start()
    deadline = time.monotonic() + 5
    while not plugin.loop_threads and time.monotonic() < deadline:
        time.sleep(0.01)
    threading.Timer(0.3, plugin.release.set).start()
    t0 = time.monotonic()
    server.stop(grace_s=5)
    caller.join(5)
    assert result == {"ok": "slow"}
    assert time.monotonic() - t0 < 5
    assert not server.path.exists()


def test_a_call_opened_once_stop_began_is_not_served_there(served) -> None:  # type: ignore[no-untyped-def]
    # As grpc-go and grpcio stop: a GOAWAY tells the client at once, so a call it opens meanwhile fails to
    # connect (or goes to the next server) instead of being cut off when the connection closes after the grace.
    plugin, server, stub = served
    result: dict[str, object] = {}

    def slow() -> None:
        result["slow"] = stub.Allocate(_allocate("slow"), timeout=10).container_responses[0].envs["IDS"]

    caller = threading.Thread(target=slow)
    caller.start()
    deadline = time.monotonic() + 5
    while not plugin.asked and time.monotonic() < deadline:
        time.sleep(0.01)
    stopper = threading.Thread(target=server.stop, kwargs={"grace_s": 5})
    stopper.start()
    time.sleep(0.3)  # the stop has begun: the slow call is held in its grace
    with pytest.raises(grpc.RpcError) as late:
        stub.Allocate(_allocate("late"), timeout=3)
    assert late.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "Stream removed" not in late.value.details()
    plugin.release.set()
    caller.join(5)
    stopper.join(5)
    assert result == {"slow": "slow"} and plugin.asked == ["slow"]


def test_a_call_opened_before_the_client_read_the_goaway_is_refused_unrun(served) -> None:  # type: ignore[no-untyped-def]
    # A client may open a call before the GOAWAY reaches it: the call is refused with REFUSED_STREAM, which
    # gRPC clients retry elsewhere as never processed, and never run. Raw HTTP/2, to open it that late.
    import socket
    import struct

    import h2.config
    import h2.connection
    from h2.errors import ErrorCodes
    from hyperframe.frame import Frame, GoAwayFrame, RstStreamFrame

    plugin, server, _ = served
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5)
    conn.connect(str(server.path))

    def open_call(ids: str) -> int:
        sid: int = client.get_next_available_stream_id()
        client.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "localhost"),
                                  (":path", "/v1beta1.DevicePlugin/Allocate"), ("content-type", "application/grpc"),
                                  ("te", "trailers")])
        body = _allocate(ids).SerializeToString()
        client.send_data(sid, struct.pack(">?I", False, len(body)) + body, end_stream=True)
        conn.sendall(client.data_to_send())
        return sid

    def frames_until(done: Callable[[list[Frame]], bool]) -> list[Frame]:
        seen: list[Frame] = []
        buf = b""
        while not done(seen):
            data = conn.recv(65536)
            if not data:
                break  # closed: what came is all there is
            buf += data
            while len(buf) >= 9:
                frame, length = Frame.parse_frame_header(memoryview(buf[:9]))
                if len(buf) < 9 + length:
                    break
                frame.parse_body(memoryview(buf[9:9 + length]))
                seen.append(frame)
                buf = buf[9 + length:]
        return seen

    client.initiate_connection()
    conn.sendall(client.data_to_send())
    try:
        first = open_call("slow")
        deadline = time.monotonic() + 5
        while not plugin.asked and time.monotonic() < deadline:
            time.sleep(0.01)
        stopper = threading.Thread(target=server.stop, kwargs={"grace_s": 5})
        stopper.start()
        time.sleep(0.3)  # the GOAWAY is on its way; this client has not read it
        late = open_call("late")
        frames = frames_until(lambda fs: any(isinstance(f, RstStreamFrame) for f in fs))
        goaway = [f for f in frames if isinstance(f, GoAwayFrame)]
        assert goaway and goaway[0].last_stream_id == first and goaway[0].error_code == 0, frames
        reset = [f for f in frames if isinstance(f, RstStreamFrame)]
        assert [(f.stream_id, f.error_code) for f in reset] == [(late, ErrorCodes.REFUSED_STREAM)], frames
        plugin.release.set()
        stopper.join(5)
    finally:
        plugin.release.set()
        conn.close()
    assert plugin.asked == ["slow"]


def test_stop_leaves_a_socket_that_is_no_longer_its_own(tmp_path: Path) -> None:
    server = rpc.UnixServer([_Plugin()], tmp_path / "dp.sock")
    server.start()
    assert server.intact()
    server.path.unlink()
    server.path.write_text("someone else's")
    assert not server.intact()
    server.stop()
    assert server.path.read_text() == "someone else's"


def test_unix_call_reaches_a_grpcio_server_and_reports_failures(tmp_path: Path) -> None:
    got: list[pb.RegisterRequest] = []

    class Registration(pb_grpc.RegistrationServicer):
        def Register(self, request, context):  # type: ignore[no-untyped-def]
            if request.resource_name == "refuse":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not this one")
            got.append(request)
            return pb.Empty()

    server = grpc.server(ThreadPoolExecutor(2))
    pb_grpc.add_RegistrationServicer_to_server(Registration(), server)
    sock = tmp_path / "kubelet.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        req = pb.RegisterRequest(version="v1beta1", endpoint="x.sock", resource_name="nvidia.com/gpu")
        rpc.unix_call(sock, lambda ch: dp_grpc.RegistrationStub(ch).Register(req), timeout_s=5)
        assert [r.resource_name for r in got] == ["nvidia.com/gpu"]
        with pytest.raises(rpc.CallFailed) as refused:
            rpc.unix_call(sock, lambda ch: dp_grpc.RegistrationStub(ch).Register(
                pb.RegisterRequest(resource_name="refuse")), timeout_s=5)
        assert refused.value.status is rpc.Status.INVALID_ARGUMENT and refused.value.message == "not this one"
    finally:
        server.stop(0)
    with pytest.raises(rpc.CallFailed) as gone:
        rpc.unix_call(tmp_path / "absent.sock", lambda ch: dp_grpc.RegistrationStub(ch).Register(req), timeout_s=2)
    assert gone.value.status is rpc.Status.UNAVAILABLE


def test_call_refuses_to_wait_on_its_own_loop() -> None:
    async def inner() -> None:
        async def nothing() -> None:
            return None
        rpc.call(nothing(), 1)

    with pytest.raises(RuntimeError, match="own thread"):
        rpc.call(inner(), 5)


def test_bytes_that_are_not_the_request_are_refused_and_the_server_goes_on(served) -> None:  # type: ignore[no-untyped-def]
    _, server, stub = served
    garbage = b"\xff\xff\xff\xff"
    raw = {"request_serializer": bytes, "response_deserializer": bytes}
    channel = grpc.insecure_channel(f"unix://{server.path}")
    try:
        with pytest.raises(grpc.RpcError) as unary:
            channel.unary_unary("/v1beta1.DevicePlugin/Allocate", **raw)(garbage, timeout=5)
        with pytest.raises(grpc.RpcError) as streamed:
            next(channel.unary_stream("/v1beta1.DevicePlugin/ListAndWatch", **raw)(garbage, timeout=5))
    finally:
        channel.close()
    for refused in (unary.value, streamed.value):
        assert refused.code() == grpc.StatusCode.INTERNAL  # as grpcio and grpc-go answer it
        assert "could not be decoded" in refused.details()
    assert stub.Allocate(_allocate("ok"), timeout=5).container_responses[0].envs["IDS"] == "ok"


def test_stop_ends_an_open_stream_at_its_client(served) -> None:  # type: ignore[no-untyped-def]
    # The kubelet takes a ListAndWatch stream's end for the plugin's: a stopped server must end it at the
    # client, not only cancel its own side (grpclib alone leaves the connection, and so the stream, open).
    plugin, server, stub = served
    call = stub.ListAndWatch(pb.Empty(), timeout=10)
    assert next(call).devices[0].ID == "v0"
    server.stop()
    with pytest.raises(grpc.RpcError) as ended:
        next(call)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert plugin.ended.wait(5)


def test_unix_call_names_localhost_as_its_authority(tmp_path: Path) -> None:
    """grpc-go and grpcio send ":authority: localhost" over a unix socket; strict HTTP/2 servers refuse the
    "None:None" grpclib would send for a path."""
    import socket

    import h2.config
    import h2.connection
    import h2.events

    sock_path = tmp_path / "h2.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(1)
    headers: dict[str, str] = {}

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
            h2c.initiate_connection()
            conn.sendall(h2c.data_to_send())
            while not headers:
                data = conn.recv(65536)
                if not data:
                    return
                for event in h2c.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        headers.update({str(k): str(v) for k, v in event.headers})
                conn.sendall(h2c.data_to_send())

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with pytest.raises(rpc.CallFailed):  # the server never answers: the call ends, after its headers
            rpc.unix_call(sock_path, lambda ch: dp_grpc.RegistrationStub(ch).Register(pb.RegisterRequest()),
                          timeout_s=1)
        server.join(5)
    finally:
        listener.close()
    assert headers.get(":authority") == "localhost", headers
    assert headers.get(":path") == "/v1beta1.Registration/Register"
