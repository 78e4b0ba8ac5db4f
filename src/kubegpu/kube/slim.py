"""Pods and Bindings as the few fields the extender reads and writes, decoded and encoded by msgspec in one step.

lightkube's full ``Pod`` model decodes every field of every pod the extender watches or reads (volumes,
probes, env, status conditions...), and the extender then converted it back to a dict: at cluster scale
most of the extender's time outside the verbs. lightkube decodes any resource class that is a msgspec
``Struct`` straight from the response bytes into that class, skipping the fields it does not declare
(``lightkube.core.decoders``), for lists, watches and GETs alike. :class:`SlimPod` declares what
the pod readers (``model.request.parse_pod``, ``model.records.read_pod``, ``scheduler.requests``,
``scheduler.accounting``) consult: identity and version, annotations, owner references, each container's
name and resources, the overhead, the node and the phase. Its ``to_dict`` is a plain v1.Pod-shaped
dict of those fields, what the readers take.

:class:`SlimBinding` is the Binding the extender posts (``pods/<name>/binding``): the same JSON as
lightkube's ``Pod.Binding`` model, and the API server's answer (a ``Status``) decodes into it without
the model's round trip.

Every field is optional, so a pod the API server accepted always decodes; types are those of the
Kubernetes schema (annotations are strings), as strict as lightkube's models on them.
"""

from __future__ import annotations

from typing import Any

import msgspec
from lightkube.core.resource import NamespacedResourceG, NamespacedSubResource

from kubegpu.kube.resources import Pod

_to_builtins = msgspec.to_builtins


class SlimOwner(msgspec.Struct, omit_defaults=True):
    kind: str | None = None
    name: str | None = None
    controller: bool | None = None


class SlimMeta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    namespace: str | None = None
    uid: str | None = None
    resourceVersion: str | None = None
    annotations: dict[str, str] | None = None
    ownerReferences: list[SlimOwner] | None = None
    creationTimestamp: str | None = None  # how long a pending pod has waited (reservations)


class SlimContainer(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    resources: dict[str, Any] | None = None  # limits, requests (quantity strings), claims


class SlimSpec(msgspec.Struct, omit_defaults=True):
    nodeName: str | None = None
    containers: list[SlimContainer] | None = None
    initContainers: list[SlimContainer] | None = None
    overhead: dict[str, Any] | None = None
    activeDeadlineSeconds: int | None = None  # a declared run time: reservations may backfill behind it
    priority: int | None = None  # reservations serve higher priority first
    schedulerName: str | None = None  # a pending pod of a profile this extender serves waits for it


class SlimStatus(msgspec.Struct, omit_defaults=True):
    phase: str | None = None
    startTime: str | None = None  # with activeDeadlineSeconds, when the pod ends at the latest


class SlimPod(NamespacedResourceG, msgspec.Struct, omit_defaults=True):
    """A v1.Pod with only the fields above; ``client.list/watch/get(SlimPod, ...)`` as with ``Pod``."""

    apiVersion: str | None = None
    kind: str | None = None
    metadata: SlimMeta | None = None
    spec: SlimSpec | None = None
    status: SlimStatus | None = None

    _api_info = Pod._api_info

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _to_builtins(self)
        return out


class SlimTarget(msgspec.Struct, omit_defaults=True):
    apiVersion: str | None = None
    kind: str | None = None
    name: str | None = None


class SlimBindingMeta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    namespace: str | None = None
    uid: str | None = None
    resourceVersion: str | None = None
    annotations: dict[str, str] | None = None


class SlimBinding(NamespacedSubResource, msgspec.Struct, omit_defaults=True):
    """``Pod.Binding`` (``POST pods/<name>/binding``), encoded as lightkube's model is."""

    apiVersion: str | None = None
    kind: str | None = None
    metadata: SlimBindingMeta | None = None
    target: SlimTarget | None = None

    _api_info = Pod.Binding._api_info


__all__ = ["SlimBinding", "SlimBindingMeta", "SlimContainer", "SlimMeta", "SlimOwner", "SlimPod", "SlimSpec",
           "SlimStatus", "SlimTarget"]
