"""A pod's parsed GPU request, parsed once per distinct request rather than once per question asked about it.

kube-scheduler's filter and prioritize, the bind, the ledger's accounting and the watch events each need
:func:`~kubegpu.model.request.parse_pod` of the same pod (~50 µs each, about eight times per pod placed).
Results are kept by what the parser reads of a pod, and only that: each container's and init container's
name and ``resources``, and the annotations that limit the GPU models (``kubegpu.io/gpu-model``, the legacy
affinity), as their JSON (a dict changed in place later cannot change what was kept), with the process's
declared GPU resources (``KUBEGPU_GPU_RESOURCES``). ``parse_pod`` is a function of exactly these, so a pod
is answered from a kept result only when that result is what parsing it would give: whichever version of
the pod (its binding, its acknowledgement and other annotations do not change it), whichever copy (a
``/filter`` body's full pod, the watch's slim one) and whichever pod (the replicas of a Deployment share one
result). A pod shaped in a way this does not describe (a spec or a container list that is not one) is parsed
uncached. Keep :func:`_read_by_parse` in step with ``parse_pod``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import msgspec

from kubegpu.model.annotations import GPU_MODEL
from kubegpu.model.legacy import LEGACY_AFFINITY
from kubegpu.model.request import PodRequest, parse_pod
from kubegpu.model.resources import GPU_RESOURCES_ENV

_encode = msgspec.json.Encoder().encode
MAX_KEPT = 4096  # distinct requests: a cluster's pods ask for a few dozen shapes
MAX_READ_BYTES = 64 * 1024  # a real pod's containers' resources are a few KiB; a larger (hostile) one is not kept
_CONTAINER_KEYS = ("initContainers", "containers")  # parse_pod's order


def _read_by_parse(pod: Mapping[str, Any]) -> bytes | None:
    """What ``parse_pod`` reads of ``pod``, as JSON; None when the pod's shape is not one this describes."""
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if not isinstance(spec, Mapping):
        return None
    parts: list[Any] = []
    for key in _CONTAINER_KEYS:
        items = spec.get(key) or []
        if not isinstance(items, list):
            return None
        parts.append([[c.get("name"), c.get("resources")] if isinstance(c, Mapping) else None for c in items])
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    if isinstance(annotations, Mapping):
        model = annotations.get(GPU_MODEL)
        if isinstance(model, str):
            parts.append(["model", model])
        elif LEGACY_AFFINITY in annotations:
            parts.append(["legacy", annotations[LEGACY_AFFINITY]])
    try:
        return _encode(parts)
    except (TypeError, ValueError, OverflowError, RecursionError):  # not JSON-shaped: no cache
        return None


class ParsedPods:
    """A bounded LRU of ``parse_pod`` results (default arguments only): at most ``limit`` requests, each read
    from at most ``MAX_READ_BYTES`` of a pod."""

    def __init__(self, limit: int = MAX_KEPT) -> None:
        self._limit = limit
        self._kept: OrderedDict[tuple[bytes, str], PodRequest] = OrderedDict()

    def __call__(self, pod: Mapping[str, Any]) -> PodRequest:
        read = _read_by_parse(pod)
        if read is None:
            return parse_pod(pod)
        key = (read, os.environ.get(GPU_RESOURCES_ENV, ""))
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            return kept
        request = parse_pod(pod)
        if len(read) > MAX_READ_BYTES:
            return request
        self._kept[key] = request
        if len(self._kept) > self._limit:
            self._kept.popitem(last=False)
        return request

    def __len__(self) -> int:
        return len(self._kept)


parsed_pod = ParsedPods()  # the process's one cache: every caller asks about the same pods
