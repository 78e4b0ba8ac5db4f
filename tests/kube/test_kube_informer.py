"""The informer: list then watch, typed events, reconnect after the stream ends, relist after 410, resync."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kubegpu.kube import EventType, Informer, Node, Pod, WatchEvent, make_async_client, make_client
from kubegpu.kube.informer import Backoff
from kubegpu.kube.writes import bind_pod
from kubegpu_standins.apiserver import ApiServer


def _pod(name: str) -> dict:
    return {"metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": [{"name": "c", "image": "x"}]}}


async def _until(cond, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_informer_lists_watches_reconnects_and_relists(apiserver: ApiServer, kubeconfig: Path) -> None:
    sync = make_client(kubeconfig)
    sync.create(Pod.from_dict(_pod("before")))

    async def scenario() -> list[tuple[EventType, str]]:
        seen: list[WatchEvent] = []
        inf = Informer(make_async_client(kubeconfig), Pod, seen.append, resync_s=30,
                       backoff=Backoff(base_s=0.05, cap_s=0.2))
        task = asyncio.create_task(inf.run())
        await asyncio.wait_for(inf.synced.wait(), 20)
        await asyncio.to_thread(sync.create, Pod.from_dict(_pod("live")))
        await _until(lambda: "default/live" in inf.cache)
        # The server ends every watch (as a restart does): the informer re-watches from its version.
        assert apiserver.drop_watches() == 1
        await asyncio.to_thread(bind_pod, sync, "default", "live", None, "n1")
        await _until(lambda: inf.cache["default/live"].spec.nodeName == "n1")
        # The server goes away; changes happen meanwhile and the history is compacted. On reconnect the
        # watch from the informer's old version gets 410, and the informer relists and hands over the diff.
        port = apiserver.port
        await asyncio.to_thread(apiserver.stop)
        apiserver.store.delete(apiserver.kind("pods"), "default", "before")
        apiserver.put_object({"apiVersion": "v1", "kind": "Pod", **_pod("after")})
        apiserver.compact()
        await asyncio.to_thread(apiserver.start, port)
        await _until(lambda: "default/after" in inf.cache and "default/before" not in inf.cache)
        assert inf.relists >= 2 and inf.reconnects >= 1
        inf.stop()
        task.cancel()
        return [(e.type, e.key) for e in seen]

    events = asyncio.run(scenario())
    assert not any(t is EventType.RELISTED for t, _ in events)  # announced only to a handler that asks
    assert events[0] == (EventType.ADDED, "default/before")
    assert (EventType.ADDED, "default/live") in events
    assert (EventType.MODIFIED, "default/live") in events
    assert (EventType.DELETED, "default/before") in events
    assert (EventType.ADDED, "default/after") in events


def test_each_relist_but_the_first_is_announced_to_a_handler_that_asks(apiserver: ApiServer, kubeconfig: Path) -> None:
    """A pod created and deleted while the watch was broken is never seen; a handler that must know up to
    where that can no longer be so (the node's handoff) is told after each relist but the first, once the
    relist's difference is handed over."""
    sync = make_client(kubeconfig)
    sync.create(Pod.from_dict(_pod("before")))

    async def scenario() -> list[WatchEvent]:
        seen: list[WatchEvent] = []
        inf = Informer(make_async_client(kubeconfig), Pod, seen.append, resync_s=30,
                       backoff=Backoff(base_s=0.05, cap_s=0.2), announce_relists=True)
        task = asyncio.create_task(inf.run())
        await asyncio.wait_for(inf.synced.wait(), 20)
        assert [e.type for e in seen] == [EventType.ADDED]  # the first list: nothing to announce
        port = apiserver.port
        await asyncio.to_thread(apiserver.stop)
        apiserver.put_object({"apiVersion": "v1", "kind": "Pod", **_pod("short-lived")})
        apiserver.store.delete(apiserver.kind("pods"), "default", "short-lived")
        apiserver.put_object({"apiVersion": "v1", "kind": "Pod", **_pod("after")})
        apiserver.compact()
        await asyncio.to_thread(apiserver.start, port)
        await _until(lambda: any(e.type is EventType.RELISTED for e in seen))
        inf.stop()
        task.cancel()
        return seen

    events = asyncio.run(scenario())
    relisted = [e for e in events if e.type is EventType.RELISTED]
    assert len(relisted) == 1 and relisted[0].obj is None and relisted[0].key == ""
    assert events.index(relisted[0]) > events.index(next(e for e in events if e.key == "default/after"))
    # Complete as of the list: past the deletion it never saw, made before "after" was created.
    assert int(relisted[0].version) >= max(int(e.obj.metadata.resourceVersion) for e in events if e.obj is not None)
    assert not any(e.key == "default/short-lived" for e in events)


def test_informer_survives_server_down_and_handler_errors(tmp_path: Path) -> None:
    server = ApiServer().start()
    kc = server.write_kubeconfig(tmp_path / "kc")
    port = server.port
    server.stop()

    async def scenario() -> int:
        calls: list[WatchEvent] = []

        def handler(ev: WatchEvent) -> None:
            calls.append(ev)
            raise RuntimeError("handler bug")  # logged; the informer goes on

        inf = Informer(make_async_client(kc), Node, handler, backoff=Backoff(base_s=0.05, cap_s=0.1))
        task = asyncio.create_task(inf.run())
        await asyncio.sleep(0.3)  # nothing listening: the informer backs off and retries
        assert not inf.synced.is_set()
        again = await asyncio.to_thread(ApiServer().start, port)
        try:
            again.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
            await asyncio.wait_for(inf.synced.wait(), 20)
            await _until(lambda: len(calls) >= 1)
        finally:
            inf.stop()
            task.cancel()
            await asyncio.to_thread(again.stop)
        return len(calls)

    assert asyncio.run(scenario()) == 1
