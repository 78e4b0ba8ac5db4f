"""Writes to the API server that take more than one plain call, and how their failures are told apart.

The pod Binding (the API server checks its UID and resourceVersion preconditions in the write that binds),
Events, and :func:`retry_async` for transient failures. :func:`is_conflict` (409: the object changed
between the read and a write that carried its resourceVersion, or the pod is bound already) and
:func:`is_not_found` (404) let each caller decide what a failure means for it. The synchronous functions
serve the node daemon and the CLI; the ``a``-prefixed ones serve the extender's event loop. Object
builders are shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
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

from kubegpu.kube.client import lightkube_http
from kubegpu.kube.kept_http import binding_client
from kubegpu.kube.resources import Event, Pod
from kubegpu.kube.slim import SlimBinding, SlimBindingMeta, SlimTarget

T = TypeVar("T")
_JSON = {"Content-Type": "application/json"}
_encode_binding = msgspec.json.Encoder().encode


def is_conflict(e: BaseException) -> bool:
    return isinstance(e, ApiError) and getattr(e.status, "code", None) == 409


def is_not_found(e: BaseException) -> bool:
    return isinstance(e, ApiError) and getattr(e.status, "code", None) == 404


def _backoff(attempt: int) -> float:
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

def bind_pod(client: Client, namespace: str, name: str, uid: str | None, node: str) -> None:
    """POST the Binding. Raises ApiError (409 when the pod is already bound)."""
    # The server answers a Binding with a Status (201), which lightkube cannot read as a Binding;
    # a non-2xx answer would have raised ApiError before decoding, so the bind succeeded.
    with contextlib.suppress(msgspec.ValidationError):
        client.create(binding_object(namespace, name, uid, node), name=name, namespace=namespace)


def emit_event(client: Client, **kw: Any) -> None:
    client.create(event_object(**kw))


# --- asyncio -------------------------------------------------------------------------------------------

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
        await asyncio.sleep(_backoff(attempt + 2))
    raise AssertionError("unreachable")
