"""Conflict-safe writes: read-modify-write with 409 retries, the pod Binding, and Events.

Every write kubegpu makes either carries the resourceVersion it read (so a
concurrent writer makes it fail with 409 instead of being overwritten) and is
retried from a fresh read, or is a merge patch that cannot clobber other
fields. The synchronous functions serve the node daemon and the CLI; the
``a``-prefixed ones serve the extender's event loop. Object builders are shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import quote

import msgspec
from lightkube import AsyncClient, Client
from lightkube.core.exceptions import ApiError
from lightkube.core.generic_client import GenericClient
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.types import PatchType

from kubegpu.kube.client import lightkube_http
from kubegpu.kube.kept_http import binding_client
from kubegpu.kube.resources import Event, Pod
from kubegpu.kube.slim import SlimBinding, SlimBindingMeta, SlimTarget

T = TypeVar("T")
_JSON = {"Content-Type": "application/json"}
_encode_binding = msgspec.json.Encoder().encode
CONFLICT_ATTEMPTS = 8


class ConflictExhausted(RuntimeError):
    """Still conflicting after every retry: someone else keeps writing the object."""


def is_conflict(e: BaseException) -> bool:
    return isinstance(e, ApiError) and getattr(e.status, "code", None) == 409


def is_not_found(e: BaseException) -> bool:
    return isinstance(e, ApiError) and getattr(e.status, "code", None) == 404


def _conflict_delay(attempt: int) -> float:
    return random.uniform(0, min(0.5, 0.01 * 2**attempt))


def binding_object(namespace: str, name: str, uid: str | None, node: str,
                   annotations: dict[str, str] | None = None) -> Any:
    """A Binding. Its annotations are copied onto the pod by the API server in the same write that sets
    ``spec.nodeName``, and its UID is a precondition (a recreated pod of that name is not bound)."""
    return Pod.Binding(metadata=ObjectMeta(name=name, namespace=namespace, uid=uid or None,
                                           annotations=annotations or None),
                       target=ObjectReference(apiVersion="v1", kind="Node", name=node))


def event_object(*, namespace: str, kind: str, name: str, uid: str | None, reason: str, message: str,
                 type_: str = "Normal", component: str = "kubegpu") -> Any:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Event(
        metadata=ObjectMeta(generateName=f"{name}.", namespace=namespace),
        involvedObject=ObjectReference(apiVersion="v1", kind=kind, name=name, namespace=namespace or None,
                                       uid=uid or None),
        reason=reason, message=message[:1024], type=type_, count=1,
        firstTimestamp=now, lastTimestamp=now,  # type: ignore[arg-type]
        source=EventSource(component=component), reportingComponent=component,
    )


# --- synchronous ---------------------------------------------------------------------------------------

def update_with_retry(client: Client, res: type, name: str, mutate: Callable[[Any], Any | None], *,
                      namespace: str | None = None, attempts: int = CONFLICT_ATTEMPTS) -> Any:
    """Read, ``mutate`` (returns the object to write, or None when nothing needs writing), replace
    with the version read; on 409 read again and retry."""
    for attempt in range(attempts):
        obj: Any = client.get(res, name, namespace=namespace) if namespace else client.get(res, name)
        new = mutate(obj)
        if new is None:
            return obj
        try:
            return client.replace(new)
        except ApiError as e:
            if not is_conflict(e):
                raise
            time.sleep(_conflict_delay(attempt))
    raise ConflictExhausted(f"{res.__name__} {name}: still conflicting after {attempts} attempts")


def bind_pod(client: Client, namespace: str, name: str, uid: str | None, node: str) -> None:
    """POST the Binding. Raises ApiError (409 when the pod is already bound)."""
    # The server answers a Binding with a Status (201), which lightkube cannot read as a Binding;
    # a non-2xx answer would have raised ApiError before decoding, so the bind succeeded.
    with contextlib.suppress(msgspec.ValidationError):
        client.create(binding_object(namespace, name, uid, node), name=name, namespace=namespace)


def emit_event(client: Client, **kw: Any) -> None:
    client.create(event_object(**kw))


# --- asyncio -------------------------------------------------------------------------------------------

async def aupdate_with_retry(client: AsyncClient, res: type, name: str, mutate: Callable[[Any], Any | None], *,
                             namespace: str | None = None, attempts: int = CONFLICT_ATTEMPTS) -> Any:
    for attempt in range(attempts):
        obj: Any = await (client.get(res, name, namespace=namespace) if namespace else client.get(res, name))
        new = mutate(obj)
        if new is None:
            return obj
        try:
            return await client.replace(new)
        except ApiError as e:
            if not is_conflict(e):
                raise
            await asyncio.sleep(_conflict_delay(attempt))
    raise ConflictExhausted(f"{res.__name__} {name}: still conflicting after {attempts} attempts")


async def apatch_with_precondition(client: AsyncClient, res: type, name: str,
                                   build: Callable[[Any], dict[str, Any] | None], *,
                                   namespace: str | None = None, attempts: int = CONFLICT_ATTEMPTS) -> Any:
    """Read, ``build`` a merge patch from what was read (None = nothing to do), send it with the
    read resourceVersion as a precondition; on 409 read again and retry. Lighter than a replace
    of the whole object and just as safe."""
    for attempt in range(attempts):
        obj: Any = await client.get(res, name, namespace=namespace)
        patch = build(obj)
        if patch is None:
            return obj
        patch.setdefault("metadata", {})["resourceVersion"] = obj.metadata.resourceVersion
        try:
            return await client.patch(res, name, patch, namespace=namespace, patch_type=PatchType.MERGE)
        except ApiError as e:
            if not is_conflict(e):
                raise
            await asyncio.sleep(_conflict_delay(attempt))
    raise ConflictExhausted(f"{res.__name__} {name}: still conflicting after {attempts} attempts")


async def abind_pod(client: AsyncClient, namespace: str, name: str, uid: str | None, node: str,
                    annotations: dict[str, str] | None = None, *, resource_version: str | None = None) -> None:
    """POST the Binding (the extender's commit). Raises ApiError (409 when the pod is already bound, is
    another pod now (``uid``), or is no longer at ``resource_version``: the API server checks both
    preconditions in the write that binds).

    The write lightkube's ``client.create(binding)`` makes (same path, ``fieldManager``, JSON and errors),
    sent with lightkube's own base URL, TLS and credentials over connections kept for Bindings
    (:mod:`kubegpu.kube.kept_http`), without lightkube's request building and model round trip, which cost
    more than the write itself on the extender's hot path: one Binding per placed pod. The answer (a Status,
    201) is only checked; an error becomes lightkube's ApiError."""
    binding = SlimBinding(apiVersion="v1", kind="Binding",
                          metadata=SlimBindingMeta(name=name, namespace=namespace, uid=uid or None,
                                                   resourceVersion=resource_version or None,
                                                   annotations=annotations or None),
                          target=SlimTarget(apiVersion="v1", kind="Node", name=node))
    _, field_manager = lightkube_http(client)
    path = f"api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}/binding"
    if field_manager:
        path += f"?fieldManager={quote(field_manager, safe='')}"
    resp = await binding_client(client).post(path, content=_encode_binding(binding), headers=_JSON)
    GenericClient.raise_for_status(resp)


async def retry_async(fn: Callable[[], Awaitable[T]], attempts: int = 3) -> T:
    """Retry a call that failed for a transient reason (5xx, connection)."""
    for attempt in range(attempts):
        try:
            return await fn()
        except ApiError as e:
            if getattr(e.status, "code", 500) < 500 or attempt == attempts - 1:
                raise
        except OSError:
            if attempt == attempts - 1:
                raise
        await asyncio.sleep(_conflict_delay(attempt + 2))
    raise AssertionError("unreachable")
