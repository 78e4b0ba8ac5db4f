"""A stand-in Kubernetes API server: a real HTTP server on 127.0.0.1 that lightkube talks to unchanged.

There is no kube-apiserver binary here, yet the extender, the node daemon's publisher, the
CLI and the local demo all talk to one through the same lightkube calls they make in a
cluster. This server keeps the behaviour those calls depend on, as the real one does:

- **Resources**: core ``pods`` (namespaced; subresources ``status`` and ``binding``),
  ``nodes`` (cluster-scoped; subresource ``status``), ``events`` and ``namespaces``
  (``/api/v1``); ``events.k8s.io/v1`` events; and the cluster-scoped custom resource
  ``devices.kubegpu.io`` (``/apis/kubegpu.io/v1alpha1/devices``, no status subresource:
  the node daemon writes ``spec`` and ``status`` through the main endpoint).
- **resourceVersion**: one cluster-wide counter; every write stamps the object. Lists carry
  ``metadata.resourceVersion``.
- **Watch** (``?watch=true``): ``ADDED``/``MODIFIED``/``DELETED`` lines of JSON. Without a
  ``resourceVersion`` (or with ``"0"``) the current objects come first as ``ADDED``, like the
  real server. With one, every change after it is replayed from a bounded history; a version
  older than the history gets an ``ERROR`` event with a 410 ``Expired`` Status (the real watch
  cache's answer), so clients relist. ``allowWatchBookmarks=true`` adds ``BOOKMARK`` events
  every ``bookmark_interval_s``; ``timeoutSeconds`` ends the stream. Field selectors
  (``metadata.name``, ``metadata.namespace``, ``spec.nodeName``, ``status.phase``,
  ``=``/``==``/``!=``) and label selectors (``k=v``, ``k!=v``, ``k``, ``!k``,
  ``k in (..)``, ``k notin (..)``) filter lists and watches; an object that starts or stops
  matching a watch's selector is sent as ``ADDED`` / ``DELETED``.
- **Writes**: ``POST`` (409 ``AlreadyExists``; ``generateName``), ``PUT`` (409 ``Conflict``
  when ``metadata.resourceVersion`` is stale), ``PATCH`` with merge, strategic-merge (lists of
  objects merged by ``name``/``type``/``containerPort`` as the real strategy keys do for the
  fields kubegpu touches) and JSON patch; a ``metadata.resourceVersion`` inside a patch is a
  precondition, as on the real server. Writes through the main endpoint keep ``status``; writes
  through ``/status`` change only ``status``. Pods get ``status.phase: Pending`` and requests
  defaulted from limits.
- **Binding**: ``POST pods/<name>/binding`` sets ``spec.nodeName`` and copies the Binding's
  ``metadata.annotations`` onto the pod in the same write, as the real server's
  ``setPodHostAndAnnotations`` does (409 when already bound, 404 for a missing pod, 409 on a UID
  or ``metadata.resourceVersion`` mismatch: both are preconditions there) and answers a 201 ``Status``.
- **Deletes** are immediate (as with ``gracePeriodSeconds=0``): there is no kubelet here to finish a
  graceful deletion, so no ``deletionTimestamp`` phase.
- **Errors**: ``Status`` objects with ``Content-Type: application/json`` (what lightkube turns
  into ``ApiError``); malformed JSON is a 400, bodies over 3 MiB a 413.

For tests it also offers direct helpers (``put_object``, ``get_object``, ``objects``),
``inject_failure()`` (answer the next requests of a verb with an error status), ``compact()``
(forget the history so old versions answer 410), ``drop_watches()`` (end every open watch
stream, as an API server restart does) and a count of requests per verb.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import json
import logging
import re
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonpatch
import jsonpointer
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Match = Callable[[Obj], bool]
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]
MAX_BODY_BYTES = 3 * 1024 * 1024  # the real server's default request size limit
_encode = msgspec.json.encode
_decode = msgspec.json.decode


def _clone(obj: Any) -> Any:
    """A deep copy of a JSON value (objects here always are): a msgspec round trip, ~8x copy.deepcopy."""
    return _decode(_encode(obj))



@dataclass(frozen=True, slots=True)
class Kind:
    """One served resource: where it lives in the URL space and what it is called."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: frozenset[str] = frozenset()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


KINDS: tuple[Kind, ...] = (
    Kind("", "v1", "pods", "Pod", True, frozenset({"status", "binding"})),
    Kind("", "v1", "nodes", "Node", False, frozenset({"status"})),
    Kind("", "v1", "events", "Event", True),
    Kind("", "v1", "namespaces", "Namespace", False, frozenset({"status"})),
    Kind("events.k8s.io", "v1", "events", "Event", True),
    Kind("kubegpu.io", "v1alpha1", "devices", "Device", False),
    # DRA (resource.k8s.io/v1): validated by kubegpu_standins.dra_validation.
    Kind("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", False),
    Kind("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", False),
    Kind("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", True, frozenset({"status"})),
    Kind("resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate", True),
)
_BY_PATH = {(k.group, k.version, k.plural): k for k in KINDS}


class ApiStatusError(Exception):
    """Answered as a Kubernetes ``Status`` with this code and reason."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure" if code >= 300 else "Success", "message": message, "reason": reason,
            "code": code}


def _json_response(obj: Any, code: int = 200) -> Response:
    return Response(_encode(obj), status_code=code, media_type="application/json")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- patches -------------------------------------------------------------------------------------------

def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return _clone(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


_MERGE_KEYS = ("name", "type", "containerPort", "mountPath", "ip", "address")


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge patch, reduced to what it means for the fields kubegpu and its tests touch:
    maps merge as in a merge patch; lists of objects that carry a merge key (``name``, ``type``,
    ...) merge item by item on that key; other lists replace; ``$patch: delete`` removes an item."""
    if not isinstance(patch, dict):
        return _clone(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):
            continue
        if v is None:
            out.pop(k, None)
        elif isinstance(v, list) and isinstance(out.get(k), list):
            out[k] = _merge_list(out[k], v)
        else:
            out[k] = strategic_merge_patch(out.get(k), v)
    return out


def _merge_list(old: list[Any], new: list[Any]) -> list[Any]:
    key = next((mk for mk in _MERGE_KEYS
                if new and all(isinstance(x, dict) and mk in x for x in new)
                and all(isinstance(x, dict) and mk in x for x in old)), None)
    if key is None:
        return _clone(new)
    merged = [dict(x) for x in old]
    for item in new:
        idx = next((i for i, x in enumerate(merged) if x.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                merged.pop(idx)
        elif idx is None:
            merged.append(strategic_merge_patch({}, item))
        else:
            merged[idx] = strategic_merge_patch(merged[idx], item)
    return merged


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch, by the ``jsonpatch`` library; failures become the API server's 4xx."""
    if not isinstance(ops, list):
        raise ApiStatusError(400, "BadRequest", "a JSON patch must be a list of operations")
    try:
        return jsonpatch.JsonPatch(ops).apply(doc)
    except jsonpatch.JsonPatchTestFailed as exc:
        raise ApiStatusError(422, "Invalid", f"JSON patch test failed: {exc}") from None
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
        raise ApiStatusError(422, "Invalid", f"JSON patch cannot be applied: {exc}") from None
    except (TypeError, KeyError, AttributeError) as exc:
        raise ApiStatusError(400, "BadRequest", f"bad JSON patch operation: {exc}") from None


# --- selectors -----------------------------------------------------------------------------------------

_FIELDS: dict[str, Callable[[dict[str, Any]], str]] = {
    "metadata.name": lambda o: (o.get("metadata") or {}).get("name", ""),
    "metadata.namespace": lambda o: (o.get("metadata") or {}).get("namespace", ""),
    "spec.nodeName": lambda o: (o.get("spec") or {}).get("nodeName") or "",
    "spec.driver": lambda o: (o.get("spec") or {}).get("driver") or "",  # ResourceSlices
    "status.phase": lambda o: (o.get("status") or {}).get("phase") or "",
    "involvedObject.name": lambda o: (o.get("involvedObject") or {}).get("name", ""),
}


def field_matcher(selector: str | None) -> Callable[[dict[str, Any]], bool]:
    if not selector:
        return lambda o: True
    tests: list[tuple[Callable[[dict[str, Any]], str], bool, str]] = []
    for term in selector.split(","):
        m = re.fullmatch(r"\s*([\w.]+)\s*(==|!=|=)\s*(.*?)\s*", term)
        if not m or m.group(1) not in _FIELDS:
            raise ApiStatusError(400, "BadRequest", f"unsupported field selector {term!r}")
        tests.append((_FIELDS[m.group(1)], m.group(2) != "!=", m.group(3)))
    return lambda o: all((get(o) == v) == eq for get, eq, v in tests)


def _split_terms(selector: str) -> list[str]:
    terms, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    terms.append(cur)
    return [t.strip() for t in terms if t.strip()]


def _in_set(key: str, values: frozenset[str], inside: bool, labels: Mapping[str, str]) -> bool:
    return (labels.get(key) in values) == inside


def _has_key(key: str, present: bool, labels: Mapping[str, str]) -> bool:
    return (key in labels) == present


def label_matcher(selector: str | None) -> Callable[[dict[str, Any]], bool]:
    if not selector:
        return lambda o: True
    tests: list[Callable[[Mapping[str, str]], bool]] = []
    for term in _split_terms(selector):
        if m := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\((.*)\)", term):
            key, op, vals = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            tests.append(functools.partial(_in_set, key, frozenset(vals), op == "in"))
        elif m := re.fullmatch(r"([\w./-]+)\s*(==|!=|=)\s*([\w./-]*)", term):
            key, op, val = m.groups()
            tests.append(functools.partial(_in_set, key, frozenset({val}), op != "!="))
        elif m := re.fullmatch(r"(!?)([\w./-]+)", term):
            neg, key = m.groups()
            tests.append(functools.partial(_has_key, key, not neg))
        else:
            raise ApiStatusError(400, "BadRequest", f"unsupported label selector {term!r}")
    return lambda o: all(t((o.get("metadata") or {}).get("labels") or {}) for t in tests)


# --- the store -----------------------------------------------------------------------------------------

@dataclass(slots=True)
class _Change:
    rv: int
    kind: Kind
    type: str  # ADDED / MODIFIED / DELETED
    old: dict[str, Any] | None
    new: dict[str, Any]


@dataclass(eq=False)
class _Watcher:
    kind: Kind
    namespace: str | None
    matches: Callable[[dict[str, Any]], bool]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Change | None] = field(default_factory=asyncio.Queue)


class Store:
    """Objects by (kind, namespace, name), the change history and the open watches. Thread-safe:
    tests write through it directly while the HTTP server serves from its own thread."""

    def __init__(self, history: int = 2000) -> None:
        self._lock = threading.RLock()
        self._objects: dict[tuple[Kind, str, str], dict[str, Any]] = {}
        self._history: deque[_Change] = deque(maxlen=history)
        self._rv = 0
        self._compacted = 0  # the newest version no longer replayable
        self._watchers: set[_Watcher] = set()
        self.requests: Counter[str] = Counter()
        self.faults: dict[str, list[int]] = {}  # "POST pods/binding" -> status codes to answer next
        # Admission for a kind (validation, defaulting): (kind, new object, old or None); raises ApiStatusError.
        self.admit: Callable[[Kind, Obj, Obj | None], None] | None = None

    @property
    def resource_version(self) -> int:
        return self._rv

    def _record(self, kind: Kind, type_: str, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
        change = _Change(self._rv, kind, type_, old, new)
        if len(self._history) == self._history.maxlen:
            self._compacted = self._history[0].rv
        self._history.append(change)
        for w in list(self._watchers):
            if w.kind is kind:
                w.loop.call_soon_threadsafe(w.queue.put_nowait, change)

    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        return obj

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            obj = self._objects.get((kind, namespace, name))
            if obj is None:
                raise ApiStatusError(404, "NotFound", f'{kind.plural} "{name}" not found')
            return _clone(obj)

    def list_page(self, kind: Kind, namespace: str | None, matches: Callable[[dict[str, Any]], bool],
                  start: int, limit: int | None) -> tuple[int, list[dict[str, Any]], bool]:
        """One page of a list (``limit`` objects from ``start``; None: all) and whether more follow. Only
        the page is copied: a client paging through 30,000 pods costs one copy of each, as with etcd."""
        with self._lock:
            refs = [o for (k, ns, _), o in self._objects.items()
                    if k is kind and (namespace is None or ns == namespace) and matches(o)]
            end = len(refs) if limit is None else start + limit
            return self._rv, [_clone(o) for o in refs[start:end]], end < len(refs)

    def list(self, kind: Kind, namespace: str | None, matches: Callable[[dict[str, Any]], bool]
             ) -> tuple[int, list[dict[str, Any]]]:
        rv, items, _ = self.list_page(kind, namespace, matches, 0, None)
        return rv, items

    def create(self, kind: Kind, namespace: str, obj: dict[str, Any], keep_uid: bool = False) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiStatusError(400, "BadRequest", "metadata must be an object")
        with self._lock:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
            name = meta.get("name")
            if not isinstance(name, str) or not name:
                raise ApiStatusError(422, "Invalid", f"{kind.kind}: metadata.name: Required value")
            key = (kind, namespace if kind.namespaced else "", name)
            if key in self._objects:
                raise ApiStatusError(409, "AlreadyExists", f'{kind.plural} "{name}" already exists')
            obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
            if kind.namespaced:
                meta["namespace"] = namespace
            else:
                meta.pop("namespace", None)
            if self.admit is not None:
                self.admit(kind, obj, None)
            if not (keep_uid and isinstance(meta.get("uid"), str) and meta["uid"]):
                meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now()
            meta.setdefault("generation", 1)
            if kind.kind == "Pod" and kind.group == "":
                _default_pod(obj)
            self._objects[key] = self._stamp(obj)
            self._record(kind, "ADDED", None, obj)
            return _clone(obj)

    def update(self, kind: Kind, namespace: str, name: str, mutate: Callable[[Obj], Obj],
               subresource: str = "") -> Obj:
        """Replace an object with ``mutate(copy)``; a stale ``metadata.resourceVersion`` in the
        result is a 409 (optimistic concurrency), as is a changed name or uid."""
        with self._lock:
            key = (kind, namespace if kind.namespaced else "", name)
            old = self._objects.get(key)
            if old is None:
                raise ApiStatusError(404, "NotFound", f'{kind.plural} "{name}" not found')
            new = mutate(_clone(old))
            if not isinstance(new, dict) or not isinstance(new.get("metadata"), dict):
                raise ApiStatusError(422, "Invalid", f"{kind.kind} {name!r}: the result must be an object "
                                                     "with metadata")
            meta = new["metadata"]
            rv = meta.get("resourceVersion")
            if rv not in (None, "") and str(rv) != old["metadata"]["resourceVersion"]:
                raise ApiStatusError(409, "Conflict",
                                     f'Operation cannot be fulfilled on {kind.plural} "{name}": the object '
                                     "has been modified; please apply your changes to the latest version and "
                                     "try again")
            if meta.get("name", name) != name:
                raise ApiStatusError(400, "BadRequest", "metadata.name cannot change")
            if meta.get("uid", old["metadata"]["uid"]) != old["metadata"]["uid"]:
                raise ApiStatusError(409, "Conflict", _uid_mismatch(meta["uid"], old["metadata"]["uid"]))
            if kind.subresources and "status" in kind.subresources:
                if subresource == "status":
                    new = dict(old, status=new.get("status"))
                else:
                    new["status"] = old.get("status")
            for fixed in ("uid", "creationTimestamp", "namespace"):
                if fixed in old["metadata"]:
                    new["metadata"][fixed] = old["metadata"][fixed]
                else:
                    new["metadata"].pop(fixed, None)
            new["apiVersion"], new["kind"] = kind.api_version, kind.kind
            if self.admit is not None:
                self.admit(kind, new, old)
            old_rv = old["metadata"]["resourceVersion"]
            if dict(new, metadata=dict(new["metadata"], resourceVersion=old_rv)) == old:
                return _clone(old)  # a no-op write keeps the version, as the real server does
            if old.get("spec") != new.get("spec"):
                new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
            self._objects[key] = self._stamp(new)
            self._record(kind, "MODIFIED", old, new)
            return _clone(new)

    def delete(self, kind: Kind, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            key = (kind, namespace if kind.namespaced else "", name)
            old = self._objects.pop(key, None)
            if old is None:
                raise ApiStatusError(404, "NotFound", f'{kind.plural} "{name}" not found')
            gone = self._stamp(_clone(old))
            self._record(kind, "DELETED", old, gone)
            return gone

    def bind(self, namespace: str, name: str, binding: Any) -> None:
        target = binding.get("target") if isinstance(binding, dict) else None
        if not isinstance(target, dict) or not isinstance(target.get("name"), str) or not target["name"]:
            raise ApiStatusError(400, "BadRequest", "a Binding needs target.name")
        if target.get("kind", "Node") != "Node":
            raise ApiStatusError(422, "Invalid", "a Binding's target must be a Node")
        bmeta = binding.get("metadata") or {}
        want_uid = bmeta.get("uid") or None
        want_rv = str(bmeta.get("resourceVersion") or "")
        extra = bmeta.get("annotations") or {}
        if not isinstance(extra, dict) or not all(isinstance(v, str) for v in extra.values()):
            raise ApiStatusError(400, "BadRequest", "a Binding's annotations must be a map of strings")

        def assign(pod: dict[str, Any]) -> dict[str, Any]:
            if want_uid and pod["metadata"]["uid"] != want_uid:
                raise ApiStatusError(409, "Conflict", _uid_mismatch(want_uid, pod["metadata"]["uid"]))
            if want_rv and pod["metadata"]["resourceVersion"] != want_rv:  # the real server's precondition
                raise ApiStatusError(409, "Conflict", _rv_mismatch(want_rv, pod["metadata"]["resourceVersion"]))
            bound = (pod.get("spec") or {}).get("nodeName")
            if bound:
                raise ApiStatusError(409, "Conflict", f"pod {name} is already assigned to node \"{bound}\"")
            pod.setdefault("spec", {})["nodeName"] = target["name"]
            if extra:  # the real server copies the Binding's annotations onto the pod, in the same write
                pod["metadata"]["annotations"] = {**(pod["metadata"].get("annotations") or {}), **extra}
            pod["metadata"].pop("resourceVersion", None)
            return pod

        self.update(_BY_PATH[("", "v1", "pods")], namespace, name, assign)

    def watch(self, kind: Kind, namespace: str | None, matches: Callable[[dict[str, Any]], bool],
              since: int | None, loop: asyncio.AbstractEventLoop) -> tuple[_Watcher, builtins.list[_Change] | None]:
        """Open a watch. Returns the changes to replay first (``None`` = too old: 410)."""
        with self._lock:
            w = _Watcher(kind, namespace, matches, loop)
            if since is None:
                replay = [_Change(self._rv, kind, "ADDED", None, _clone(o))
                          for (k, ns, _), o in self._objects.items()
                          if k is kind and (namespace is None or ns == namespace) and matches(o)]
            elif since < self._compacted:
                return w, None
            else:
                replay = [c for c in self._history if c.rv > since and c.kind is kind]
            self._watchers.add(w)
            return w, replay

    def unwatch(self, w: _Watcher) -> None:
        with self._lock:
            self._watchers.discard(w)

    def compact(self) -> None:
        """Forget the history: watches from any older version now get 410 Gone."""
        with self._lock:
            self._history.clear()
            self._compacted = self._rv

    def drop_watches(self) -> int:
        """End every open watch stream (clients see the connection end and must re-watch)."""
        with self._lock:
            ws = list(self._watchers)
            self._watchers.clear()
        for w in ws:
            w.loop.call_soon_threadsafe(w.queue.put_nowait, None)
        return len(ws)


def _rv_mismatch(wanted: str, actual: str) -> str:
    return (f"Operation cannot be fulfilled on pods: the ResourceVersion in the precondition ({wanted}) does "
            f"not match the ResourceVersion in record ({actual}). The object might have been modified")


def _uid_mismatch(wanted: str, actual: str) -> str:
    return f"Precondition failed: UID in precondition: {wanted}, UID in object meta: {actual}"


def _default_pod(pod: dict[str, Any]) -> None:
    spec = pod.setdefault("spec", {})
    for key in ("initContainers", "containers"):
        for c in spec.get(key) or []:
            res = c.get("resources") if isinstance(c, dict) else None
            if isinstance(res, dict) and isinstance(res.get("limits"), dict):
                reqs = res.setdefault("requests", {})
                if isinstance(reqs, dict):
                    for name, value in res["limits"].items():
                        reqs.setdefault(name, value)
    status = pod.setdefault("status", {})
    if isinstance(status, dict):
        status.setdefault("phase", "Pending")


# --- HTTP ----------------------------------------------------------------------------------------------

def _visible(change: _Change, w: _Watcher) -> tuple[str, dict[str, Any]] | None:
    def inside(o: dict[str, Any] | None) -> bool:
        if o is None:
            return False
        if w.namespace is not None and (o.get("metadata") or {}).get("namespace") != w.namespace:
            return False
        return w.matches(o)

    was, now = inside(change.old), inside(change.new)
    if change.type == "DELETED":
        return ("DELETED", change.new) if was else None
    if was and now:
        return "MODIFIED", change.new
    if now:
        return "ADDED", change.new
    if was:
        return "DELETED", change.new
    return None


class ApiServer:
    """The stand-in API server. ``start()`` serves on 127.0.0.1 (port 0 = ephemeral) in a thread."""

    def __init__(self, *, history: int = 2000, bookmark_interval_s: float = 1.0) -> None:
        self.store = Store(history)
        from kubegpu_standins.dra_validation import admit as dra_admit
        self.store.admit = dra_admit
        self.bookmark_interval_s = bookmark_interval_s
        # One-way network latency to every client (a request costs a round trip before it is handled; a watch
        # pays it once when it opens): what the recorded runs had between the components and the API server.
        self.latency_s = 0.0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.app = Starlette(routes=[
            Route("/api/{version}/{rest:path}", self._dispatch, methods=_METHODS),
            Route("/apis/{group}/{version}/{rest:path}", self._dispatch, methods=_METHODS),
            Route("/version", self._version),
            Route("/healthz", self._healthz),
        ])

    # -- lifecycle --

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int = 0) -> ApiServer:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1, access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="standin-apiserver", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the stand-in API server did not start")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self.store.drop_watches()
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> ApiServer:
        return self.start() if self._server is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        """A kubeconfig pointing at this server (plain HTTP, no credentials)."""
        path = Path(path)
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "standin", "user": {}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "standin",
                                                         "namespace": namespace}}],
        }
        path.write_text(json.dumps(cfg, indent=2))
        return path

    # -- direct helpers for tests and the demo --

    def kind(self, plural: str, group: str = "", version: str = "") -> Kind:
        for k in KINDS:
            if k.plural == plural and k.group == group and (not version or k.version == version):
                return k
        raise KeyError(plural)

    def put_object(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create an object (``kind``/``apiVersion`` pick the resource); status is kept as given, and so
        is a ``metadata.uid`` (so recorded objects, such as the scheduler fixtures' pods, keep theirs)."""
        api_version = obj.get("apiVersion", "v1")
        group, _, version = api_version.rpartition("/")
        kind = next(k for k in KINDS
                    if k.kind == obj.get("kind") and k.group == group and k.version == version)
        ns = (obj.get("metadata") or {}).get("namespace") or "default"
        return self.store.create(kind, ns, _clone(obj), keep_uid=True)

    def get_object(self, plural: str, name: str, namespace: str = "", group: str = "") -> dict[str, Any]:
        return self.store.get(self.kind(plural, group), namespace, name)

    def objects(self, plural: str, group: str = "", namespace: str | None = None) -> list[dict[str, Any]]:
        return self.store.list(self.kind(plural, group), namespace, lambda o: True)[1]

    def compact(self) -> None:
        self.store.compact()

    def inject_failure(self, verb: str, *codes: int) -> None:
        """Answer the next requests of ``verb`` (e.g. ``"POST pods/binding"``) with these status codes."""
        self.store.faults.setdefault(verb, []).extend(codes)

    def drop_watches(self) -> int:
        return self.store.drop_watches()

    # -- HTTP handlers --

    async def _version(self, request: Request) -> Response:
        return _json_response({"major": "1", "minor": "30", "gitVersion": "v1.30.0-kubegpu-standin"})

    async def _healthz(self, request: Request) -> Response:
        return Response("ok", media_type="text/plain")

    async def _dispatch(self, request: Request) -> Response:
        if self.latency_s > 0:
            watch = request.query_params.get("watch") in ("true", "1")
            await asyncio.sleep(self.latency_s if watch else 2 * self.latency_s)
        try:
            return await self._handle(request)
        except ApiStatusError as e:
            return _json_response(status_body(e.code, e.reason, e.message), e.code)
        except ClientDisconnect:
            # The client went away while its body was read (a process stopping mid-request): nothing to answer,
            # and not a fault of this server, so no error is logged (the real API server logs none either).
            log.debug("stand-in API server: %s %s: the client disconnected", request.method, request.url.path)
            return Response(status_code=499)
        except Exception as e:  # a bug here must surface as a 500 Status, never a dropped connection
            log.exception("stand-in API server: %s %s failed", request.method, request.url.path)
            return _json_response(status_body(500, "InternalError", f"internal error: {e}"), 500)

    def _route(self, request: Request) -> tuple[Kind, str | None, str | None, str]:
        p = request.path_params
        group = p.get("group", "")
        parts = [x for x in p["rest"].split("/") if x]
        namespace: str | None = None
        if len(parts) >= 3 and parts[0] == "namespaces":
            namespace, parts = parts[1], parts[2:]
        if not parts or len(parts) > 3:
            raise ApiStatusError(404, "NotFound", f"the server could not find the requested resource "
                                                  f"({request.url.path})")
        kind = _BY_PATH.get((group, p["version"], parts[0]))
        if kind is None:
            raise ApiStatusError(404, "NotFound", f"the server could not find the requested resource "
                                                  f"({request.url.path})")
        if kind.namespaced and namespace is None and len(parts) > 1:
            raise ApiStatusError(404, "NotFound", f"{kind.plural} is namespaced")
        if not kind.namespaced and namespace is not None:
            raise ApiStatusError(404, "NotFound", f"{kind.plural} is cluster-scoped")
        name = parts[1] if len(parts) > 1 else None
        sub = parts[2] if len(parts) > 2 else ""
        if sub and sub not in kind.subresources:
            raise ApiStatusError(404, "NotFound", f"{kind.plural} has no subresource {sub!r}")
        return kind, namespace, name, sub

    async def _body(self, request: Request) -> Any:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiStatusError(413, "RequestEntityTooLarge", "the request body is too large")
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ApiStatusError(400, "BadRequest", f"the body is not valid JSON: {e}") from None

    async def _handle(self, request: Request) -> Response:
        kind, namespace, name, sub = self._route(request)
        method, q = request.method, request.query_params
        verb = f"{method} {kind.plural}{'/' + sub if sub else ''}"
        self.store.requests[verb] += 1
        if self.store.faults.get(verb):
            code = self.store.faults[verb].pop(0)
            raise ApiStatusError(code, "InternalError" if code >= 500 else "Injected", f"injected failure ({verb})")
        ns = namespace or ""
        if method == "GET" and name is None:
            matches = _and(field_matcher(q.get("fieldSelector")), label_matcher(q.get("labelSelector")))
            if q.get("watch") in ("true", "1"):
                return await self._watch(request, kind, namespace, matches)
            limit, cont = q.get("limit"), q.get("continue")
            start = int(cont) if cont and cont.isdigit() else 0
            size = int(limit) if limit and limit.isdigit() and int(limit) > 0 else None
            rv, items, more = self.store.list_page(kind, namespace, matches, start, size)
            meta: dict[str, Any] = {"resourceVersion": str(rv)}
            if more and size is not None:
                meta["continue"] = str(start + size)
            return _json_response({"kind": f"{kind.kind}List", "apiVersion": kind.api_version, "metadata": meta,
                                   "items": items})
        if method == "GET":
            return _json_response(self.store.get(kind, ns, name or ""))
        if method == "POST" and sub == "binding":
            self.store.bind(ns, name or "", await self._body(request))
            return _json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                   "code": 201}, 201)
        if method == "POST":
            if name is not None:
                raise ApiStatusError(405, "MethodNotAllowed", "POST goes to the collection")
            body = await self._body(request)
            if not isinstance(body, dict):
                raise ApiStatusError(400, "BadRequest", "the body must be a JSON object")
            return _json_response(self.store.create(kind, ns, body), 201)
        if method == "DELETE" and name is None:  # DeleteCollection (the kubelet wipes a node's ResourceSlices)
            matches = _and(field_matcher(q.get("fieldSelector")), label_matcher(q.get("labelSelector")))
            _, items = self.store.list(kind, namespace, matches)
            for it in items:
                m = it["metadata"]
                with contextlib.suppress(ApiStatusError):
                    self.store.delete(kind, m.get("namespace", ""), m["name"])
            return _json_response(self._paged(kind, self.store.resource_version, items, None, None))
        if name is None:
            raise ApiStatusError(405, "MethodNotAllowed", f"{method} needs an object name")
        if method == "PUT":
            body = await self._body(request)
            if not isinstance(body, dict):
                raise ApiStatusError(400, "BadRequest", "the body must be a JSON object")
            return _json_response(self.store.update(kind, ns, name, lambda old: body, sub))
        if method == "PATCH":
            body = await self._body(request)
            ctype = request.headers.get("content-type", "").split(";")[0].strip()
            return _json_response(self.store.update(kind, ns, name, _patcher(ctype, body), sub))
        if method == "DELETE":
            return _json_response(self.store.delete(kind, ns, name))
        raise ApiStatusError(405, "MethodNotAllowed", f"{method} is not supported")

    def _paged(self, kind: Kind, rv: int, items: list[dict[str, Any]], limit: str | None,
               cont: str | None) -> dict[str, Any]:
        start = int(cont) if cont and cont.isdigit() else 0
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if limit and limit.isdigit() and int(limit) > 0:
            end = start + int(limit)
            if end < len(items):
                meta["continue"] = str(end)
            items = items[start:end]
        return {"kind": f"{kind.kind}List", "apiVersion": kind.api_version, "metadata": meta, "items": items}

    async def _watch(self, request: Request, kind: Kind, namespace: str | None,
                     matches: Callable[[dict[str, Any]], bool]) -> Response:
        q = request.query_params
        rv_param = q.get("resourceVersion")
        since: int | None = None
        if rv_param not in (None, "", "0"):
            if not rv_param.isdigit():
                raise ApiStatusError(400, "BadRequest", f"invalid resourceVersion {rv_param!r}")
            since = int(rv_param)
        timeout = float(q["timeoutSeconds"]) if (q.get("timeoutSeconds") or "").isdigit() else None
        bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
        loop = asyncio.get_running_loop()
        w, replay = self.store.watch(kind, namespace, matches, since, loop)

        async def lines() -> AsyncIterator[bytes]:
            try:
                if replay is None:
                    err = status_body(410, "Expired", f"too old resource version: {since} "
                                                      f"({self.store.resource_version})")
                    yield _encode({"type": "ERROR", "object": err}) + b"\n"
                    return
                for change in replay:
                    if (ev := _visible(change, w)) is not None:
                        yield _encode({"type": ev[0], "object": ev[1]}) + b"\n"
                deadline = loop.time() + timeout if timeout else None
                while True:
                    wait = self.bookmark_interval_s if bookmarks else None
                    if deadline is not None:
                        left = deadline - loop.time()
                        if left <= 0:
                            return
                        wait = left if wait is None else min(wait, left)
                    try:
                        pending: _Change | None = await asyncio.wait_for(w.queue.get(), wait)
                    except TimeoutError:
                        if bookmarks:
                            yield _encode({"type": "BOOKMARK", "object": {
                                "kind": kind.kind, "apiVersion": kind.api_version,
                                "metadata": {"resourceVersion": str(self.store.resource_version)}}}) + b"\n"
                        continue
                    if pending is None:
                        return
                    if (ev := _visible(pending, w)) is not None:
                        yield _encode({"type": ev[0], "object": ev[1]}) + b"\n"
            finally:
                self.store.unwatch(w)

        return StreamingResponse(lines(), media_type="application/json")


def _and(a: Match, b: Match) -> Match:
    return lambda o: a(o) and b(o)


def _patcher(ctype: str, body: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    if ctype == "application/merge-patch+json":
        fn: Callable[[Any, Any], Any] = merge_patch
    elif ctype == "application/strategic-merge-patch+json":
        fn = strategic_merge_patch
    elif ctype == "application/json-patch+json":
        fn = json_patch
    else:
        raise ApiStatusError(415, "UnsupportedMediaType", f"unsupported patch type {ctype!r}")
    if ctype != "application/json-patch+json" and not isinstance(body, dict):
        raise ApiStatusError(400, "BadRequest", "a merge patch must be a JSON object")

    def apply(old: dict[str, Any]) -> dict[str, Any]:
        current_rv = old["metadata"].get("resourceVersion")
        new = fn(old, body)
        if isinstance(new, dict) and isinstance(new.get("metadata"), dict):
            # Only a resourceVersion written in the patch itself is a precondition.
            patched_rv = new["metadata"].get("resourceVersion")
            if patched_rv == current_rv:
                new["metadata"].pop("resourceVersion", None)
        return new

    return apply


def main() -> None:  # pragma: no cover - manual use: python -m kubegpu_standins.apiserver
    import argparse

    parser = argparse.ArgumentParser(description="Run the stand-in Kubernetes API server.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kubeconfig", default="standin.kubeconfig")
    args = parser.parse_args()
    server = ApiServer().start(args.port)
    server.write_kubeconfig(args.kubeconfig)
    print(f"serving on {server.url}; kubeconfig written to {args.kubeconfig}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":  # pragma: no cover
    main()
