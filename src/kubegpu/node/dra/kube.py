"""The DRA driver's API edge: reading ResourceClaims, and keeping the node's ResourceSlices published.

The kubelet deletes every ResourceSlice of its node when it starts, and the driver's slices 30 s
after the plugin's socket goes away (recorded, fixtures ``dra-v1.36`` s7). So publishing is a
reconcile, not a one-off: :class:`SlicePublisher` compares what should exist with what does
and writes the difference. It runs on a thread, woken by a watch on the node's slices (a
deletion is repaired at once), by health changes, and by a periodic resync. Every change of
content bumps the pool generation, so schedulers drop the old slices of the pool.

Slices are owned by their Node (``ownerReferences``, as the upstream kubelet-plugin helper sets),
so the garbage collector removes them with a deleted Node. The Node's UID is read once (GET, the
driver's only read of a Node); if it cannot be read, slices are published without the owner and
it is added at a later reconcile.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from lightkube import ApiError, Client
from lightkube.generic_resource import create_global_resource, create_namespaced_resource
from lightkube.resources.core_v1 import Node

from kubegpu.node.dra.names import API_GROUP, API_VERSION, DRIVER
from kubegpu.node.dra.prepare import PrepareError

log = logging.getLogger(__name__)

ResourceSlice = create_global_resource(API_GROUP, API_VERSION, "ResourceSlice", "resourceslices")
ResourceClaim = create_namespaced_resource(API_GROUP, API_VERSION, "ResourceClaim", "resourceclaims")
DeviceClass = create_global_resource(API_GROUP, API_VERSION, "DeviceClass", "deviceclasses")


class ApiClaimReader:
    """GET /apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims/<name>."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            return self.client.get(ResourceClaim, name, namespace=namespace).to_dict()  # type: ignore[no-any-return]
        except ApiError as exc:
            raise PrepareError(f"cannot read ResourceClaim {namespace}/{name}: {exc.status.message}") from exc
        except Exception as exc:  # transport errors: the kubelet retries the prepare
            raise PrepareError(f"cannot read ResourceClaim {namespace}/{name}: {exc}") from exc


def _content(spec: dict[str, Any]) -> dict[str, Any]:
    """A slice spec without the pool generation (what decides whether to write)."""
    pool = dict(spec.get("pool") or {})
    pool.pop("generation", None)
    return dict(spec, pool=pool)


def _owners(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: o.get(k) for k in ("apiVersion", "kind", "name", "uid")}
            for o in (obj.get("metadata") or {}).get("ownerReferences") or []]


class SlicePublisher:
    """Keeps ``desired()`` published as the node's ResourceSlices of this driver."""

    def __init__(self, client: Client, node_name: str,
                 desired: Callable[[int], list[dict[str, Any]]], *, resync_s: float = 30.0,
                 watch: bool = True, on_published: Callable[[float], None] | None = None) -> None:
        self.client = client
        self.node = node_name
        self.desired = desired  # generation -> slice bodies
        self.resync_s = resync_s
        self.use_watch = watch
        self.on_published = on_published
        self.generation = 0
        self.writes = 0
        self.last_error = ""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._synced = threading.Event()
        self._owner: dict[str, Any] | None = None
        self._owner_warned = False

    # ----- lifecycle ---------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return bool(self._threads)

    def start(self) -> None:
        self._stop.clear()
        t = threading.Thread(target=self._run, name="kubegpu-dra-slices", daemon=True)
        t.start()
        self._threads = [t]
        if self.use_watch:
            w = threading.Thread(target=self._watch, name="kubegpu-dra-slice-watch", daemon=True)
            w.start()
            self._threads.append(w)

    def stop(self, close_client: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if close_client:
            with contextlib.suppress(Exception):
                self.client.close()  # ends a watch blocked on the stream
        for t in self._threads:
            t.join(timeout=2)
        self._threads = []

    def wake(self) -> None:
        self._wake.set()

    def wait_synced(self, timeout_s: float = 10.0) -> bool:
        return self._synced.wait(timeout_s)

    def _run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            self._wake.clear()
            started = time.monotonic()
            try:
                self.reconcile()
                self.last_error = ""
                backoff = 0.2
                self._synced.set()
                if self.on_published is not None:
                    self.on_published(time.monotonic() - started)
                timeout = self.resync_s
            except Exception as exc:
                self.last_error = str(exc)
                log.warning("publishing ResourceSlices failed: %s; retrying in %.1fs", exc, backoff)
                timeout, backoff = backoff, min(10.0, backoff * 2)
            self._wake.wait(timeout=timeout)

    def _watch(self) -> None:
        """Wake the publisher on any change to the node's slices (the kubelet deletes them)."""
        while not self._stop.is_set():
            try:
                for _op, obj in self.client.watch(ResourceSlice, fields={"spec.nodeName": self.node}):
                    if self._stop.is_set():
                        return
                    spec = obj.to_dict().get("spec") or {}
                    if spec.get("driver") == DRIVER:
                        self._wake.set()
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.info("ResourceSlice watch ended (%s); watching again", exc)
                self._stop.wait(1.0)
                self._wake.set()  # we may have missed a deletion

    # ----- reconcile ---------------------------------------------------------------------------

    def current(self) -> dict[str, dict[str, Any]]:
        items = self.client.list(ResourceSlice, fields={"spec.nodeName": self.node})
        out = {}
        for it in items:
            d = it.to_dict()
            if (d.get("spec") or {}).get("driver") == DRIVER:
                out[d["metadata"]["name"]] = d
        return out

    def node_owner(self) -> dict[str, Any] | None:
        """The owner reference to this node (cached once read); None while the Node cannot be read."""
        if self._owner is None:
            try:
                node = self.client.get(Node, self.node)
            except Exception as exc:
                if not self._owner_warned:
                    log.warning("cannot read Node %s (%s): ResourceSlices are published without their owner "
                                "reference until it can be read", self.node, exc)
                    self._owner_warned = True
                return None
            uid = node.metadata.uid if node.metadata is not None else None
            if uid:
                self._owner = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid,
                               "controller": True}
        return self._owner

    def _desired(self, generation: int) -> list[dict[str, Any]]:
        owner = self.node_owner()
        want = self.desired(generation)
        if owner is None:
            return want
        return [dict(b, metadata=dict(b["metadata"], ownerReferences=[owner])) for b in want]

    def reconcile(self) -> int:
        """Write what differs; returns the number of writes."""
        have = self.current()
        gens = [int(((o.get("spec") or {}).get("pool") or {}).get("generation", 0)) for o in have.values()]
        if self.generation == 0:
            self.generation = max(gens, default=0) or 1
        want = self._desired(self.generation)
        want_names = {b["metadata"]["name"] for b in want}
        same = (set(have) == want_names and
                all(_content(have[b["metadata"]["name"]]["spec"]) == _content(b["spec"]) for b in want) and
                all(_owners(have[b["metadata"]["name"]]) == _owners(b) for b in want))
        writes = 0
        if same and all(g == self.generation for g in gens):
            return 0
        if not same:
            self.generation = max([self.generation, *gens]) + 1 if have else self.generation
            want = self._desired(self.generation)
        for body in want:
            name = body["metadata"]["name"]
            old = have.get(name)
            if old is None:
                self.client.create(ResourceSlice.from_dict(body))
            else:
                body = dict(body, metadata=dict(body["metadata"],
                                                resourceVersion=old["metadata"].get("resourceVersion")))
                self.client.replace(ResourceSlice.from_dict(body))
            writes += 1
        for name in set(have) - want_names:
            try:
                self.client.delete(ResourceSlice, name)
                writes += 1
            except ApiError as exc:
                if exc.status.code != 404:
                    raise
        self.writes += writes
        log.info("published %d ResourceSlice write(s) for node %s (pool generation %d)",
                 writes, self.node, self.generation)
        return writes
