"""A pod's parsed GPU request, parsed once per pod version rather than once per question asked about it.

kube-scheduler's filter and prioritize, the bind, the ledger's accounting and the watch events each need
:func:`~kubegpu.model.request.parse_pod` of the same pod (~50 µs each, about eight times per pod placed).
Results are kept by the pod's UID and resourceVersion, and reused only when the parts of the pod the
parser reads (``spec`` and ``metadata.annotations``, kept as their JSON: a dict changed in place later
cannot change what was kept) are equal to those it was parsed from, and the
process's declared GPU resources (``KUBEGPU_GPU_RESOURCES``) are the same: a body that claims a pod's
version but says something else about it is parsed afresh, never answered from another's result.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import msgspec

from kubegpu.model.request import PodRequest, parse_pod
from kubegpu.model.resources import GPU_RESOURCES_ENV

_encode = msgspec.json.Encoder().encode
MAX_KEPT = 4096  # pod versions: a burst of pending pods, each asked about a few times within seconds
MAX_READ_BYTES = 64 * 1024  # a real pod's spec and annotations are a few KiB; a larger (hostile) one is not kept


class ParsedPods:
    """A bounded LRU of ``parse_pod`` results (default arguments only): at most ``limit`` pods of at most
    ``MAX_READ_BYTES`` each."""

    def __init__(self, limit: int = MAX_KEPT) -> None:
        self._limit = limit
        self._kept: OrderedDict[tuple[str, str, str], tuple[bytes, PodRequest]] = OrderedDict()

    def __call__(self, pod: Mapping[str, Any]) -> PodRequest:
        meta = pod.get("metadata") if isinstance(pod, Mapping) else None
        if not isinstance(meta, Mapping):
            return parse_pod(pod)
        uid, version = meta.get("uid"), meta.get("resourceVersion")
        if not (isinstance(uid, str) and uid and isinstance(version, str) and version):
            return parse_pod(pod)
        key = (uid, version, os.environ.get(GPU_RESOURCES_ENV, ""))
        try:
            read = _encode((pod.get("spec"), meta.get("annotations")))
        except (TypeError, ValueError, OverflowError, RecursionError):  # not JSON-shaped: no cache
            return parse_pod(pod)
        kept = self._kept.get(key)
        if kept is not None and kept[0] == read:
            self._kept.move_to_end(key)
            return kept[1]
        request = parse_pod(pod)
        if len(read) > MAX_READ_BYTES:
            return request
        self._kept[key] = (read, request)
        self._kept.move_to_end(key)
        if len(self._kept) > self._limit:
            self._kept.popitem(last=False)
        return request

    def __len__(self) -> int:
        return len(self._kept)


parsed_pod = ParsedPods()  # the process's one cache: every caller asks about the same pods
