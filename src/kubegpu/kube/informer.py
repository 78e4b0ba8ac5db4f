"""List + watch of one resource kind with resourceVersion, resync and reconnect: role code sees typed events.

An :class:`Informer` lists the objects, hands each to the role's handler as
``ADDED``, then watches from the list's resourceVersion. When the stream ends
it re-watches from the last version it saw; on a 410 (version too old), or when
one watch has run ``resync_s`` without ending (the API server ends a healthy one
after ``server_timeout_s``, so that is a watch gone silent), it relists and hands
over the difference (``ADDED`` / ``MODIFIED`` / ``DELETED``), so a missed event
is repaired, not lost. Transport and API
errors back off exponentially (with jitter) and never end the informer. The
handler is a plain function called in the event loop; a handler that raises is
logged and the informer carries on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import httpx2
import msgspec
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError, NotReadyError
from lightkube.core.resource import NamespacedResource

log = logging.getLogger(__name__)


class EventType(StrEnum):
    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"
    # Only to a handler that asks (``announce_relists``): a relist after the first rebuilt the cache, complete
    # as of ``version``; no object. An object created and deleted while the watch was broken (expired, cut,
    # or silently dead until the periodic resync) was never seen, and this says up to where that can no
    # longer be so. A healthy watch is never relisted: the API server ends it after ``server_timeout_s``,
    # before ``resync_s``, and it resumes from its version; a relist follows a 410, an API error, or a watch
    # silent for ``resync_s``.
    RELISTED = "RELISTED"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change to one object. ``old`` is the previous version the informer held (None for ADDED).
    ``version``: the resourceVersion of the change when it is not the object's own: a deletion a relist
    found (the object is the last version held, older than its deletion) is known as of the LIST's."""

    type: EventType
    obj: Any
    old: Any = None
    version: str = ""

    @property
    def key(self) -> str:
        return object_key(self.obj) if self.obj is not None else ""


def object_key(obj: Any) -> str:
    meta = obj.metadata
    return f"{meta.namespace}/{meta.name}" if meta.namespace else str(meta.name)


def _rv(obj: Any) -> str:
    return str(obj.metadata.resourceVersion or "")


@dataclass(slots=True)
class Backoff:
    """Exponential backoff with full jitter: the n-th failure waits up to ``base * 2**n`` (capped)."""

    base_s: float = 0.2
    cap_s: float = 10.0
    failures: int = 0

    def next_delay(self) -> float:
        self.failures += 1
        return random.uniform(self.base_s / 2, min(self.cap_s, self.base_s * 2 ** (self.failures - 1)))

    def reset(self) -> None:
        self.failures = 0


LIST_PAGE = 500


class Informer:
    """Keeps a cache of one kind in step with the API server and tells the handler about changes."""

    def __init__(self, client: AsyncClient, resource: type, handler: Callable[[WatchEvent], None], *,
                 namespace: str | None = "*", fields: Mapping[str, Any] | None = None,
                 labels: dict[str, str] | None = None, resync_s: float = 300.0,
                 server_timeout_s: int = 240, backoff: Backoff | None = None, name: str = "",
                 keep: Callable[[Any], Any] | None = None, announce_relists: bool = False) -> None:
        """``keep``: what the cache holds of each object (the object itself by default). It must keep the
        metadata's name, namespace and resourceVersion, and whatever the handler reads of a deleted
        object; a handler that keeps its own view passes a slim copy, since at cluster scale the cache
        of full objects is most of the process's memory. ``announce_relists``: the handler is also told
        (``RELISTED``) after each relist but the first, once the relist's difference is handed over."""
        self._client = client
        self._keep = keep or (lambda obj: obj)
        self._res = resource
        self._handler = handler
        self._namespace = namespace
        self._fields = fields
        self._labels = labels
        self.resync_s = resync_s
        self._server_timeout = server_timeout_s
        self._backoff = backoff or Backoff()
        self.name = name or resource.__name__
        self.cache: dict[str, Any] = {}
        self.resource_version = ""
        self.synced = asyncio.Event()
        self.relists = 0
        self.reconnects = 0
        self._stopping = False
        self._announce_relists = announce_relists

    def _kw(self) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if self._namespace is not None and issubclass(self._res, NamespacedResource):
            kw["namespace"] = self._namespace
        if self._fields:
            kw["fields"] = self._fields
        if self._labels:
            kw["labels"] = self._labels
        return kw

    def _deliver(self, event: WatchEvent) -> None:
        try:
            self._handler(event)
        except Exception:
            log.exception("informer %s: handler failed on %s %s", self.name, event.type, event.key)

    async def relist(self) -> None:
        """List everything and hand over the difference against the cache. The list comes in pages
        (``LIST_PAGE`` objects, as client-go's reflector asks) and each page is handed over as it comes,
        so that only one page of full objects is alive at a time, whatever the cluster's size."""
        listing: Any = self._client.list(self._res, chunk_size=LIST_PAGE, **self._kw())
        fresh: set[str] = set()
        async for obj in listing:
            key = object_key(obj)
            fresh.add(key)
            old = self.cache.get(key)
            self.cache[key] = self._keep(obj)
            if old is None:
                self._deliver(WatchEvent(EventType.ADDED, obj))
            elif _rv(old) != _rv(obj):
                self._deliver(WatchEvent(EventType.MODIFIED, obj, old))
        self.relists += 1
        with contextlib.suppress(NotReadyError):  # no version sent: the watch starts from "now"
            self.resource_version = listing.resourceVersion
        for key in [k for k in self.cache if k not in fresh]:
            old = self.cache.pop(key)
            self._deliver(WatchEvent(EventType.DELETED, old, old, version=self.resource_version))
        if self._announce_relists and self.synced.is_set() and self.resource_version:
            self._deliver(WatchEvent(EventType.RELISTED, None, version=self.resource_version))
        self.synced.set()

    async def _watch(self) -> None:
        stream: Any = self._client.watch(self._res, resource_version=self.resource_version or None,
                                    server_timeout=self._server_timeout, **self._kw())
        async for kind, obj in stream:
            self._backoff.reset()
            rv = _rv(obj)
            if rv:
                self.resource_version = rv
            if kind == "BOOKMARK":
                continue
            key = object_key(obj)
            old = self.cache.get(key)
            if kind == "DELETED":
                self.cache.pop(key, None)
                self._deliver(WatchEvent(EventType.DELETED, obj, old))
            elif kind in ("ADDED", "MODIFIED"):
                self.cache[key] = self._keep(obj)
                typ = EventType.MODIFIED if old is not None else EventType.ADDED
                self._deliver(WatchEvent(typ, obj, old))

    async def run(self) -> None:
        """Run until :meth:`stop` or cancellation."""
        need_list = True
        while not self._stopping:
            try:
                if need_list:
                    await self.relist()
                    need_list = False
                try:
                    await asyncio.wait_for(self._watch(), timeout=self.resync_s)
                except TimeoutError:
                    need_list = True  # periodic resync
                    continue
                self.reconnects += 1  # the stream ended by itself: watch again from where we were
            except asyncio.CancelledError:
                raise
            except ApiError as e:
                code = getattr(e.status, "code", None)
                if code == 410:
                    log.info("informer %s: resourceVersion %s expired; relisting", self.name,
                             self.resource_version)
                    need_list = True
                    continue
                delay = self._backoff.next_delay()
                log.warning("informer %s: API error %s (%s); retrying in %.1fs", self.name, code,
                            getattr(e.status, "message", e), delay)
                need_list = need_list or code in (404, 500, 503)
                self.reconnects += 1
                await asyncio.sleep(delay)
            except (httpx2.HTTPError, OSError, msgspec.DecodeError, ValueError) as e:
                delay = self._backoff.next_delay()
                log.warning("informer %s: connection problem (%s: %s); reconnecting in %.1fs", self.name,
                            type(e).__name__, e, delay)
                self.reconnects += 1
                await asyncio.sleep(delay)

    def stop(self) -> None:
        self._stopping = True
