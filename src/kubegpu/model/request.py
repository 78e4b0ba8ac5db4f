"""A container's GPU request: parsed, validated and normalised once, for every role.

The webhook (admission and patches), the extender (fit), the simulator and
``kubegpu check`` all call :func:`parse_pod`, so a rule of the resource protocol
(ARCHITECTURE.md) is written exactly once, here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kubegpu.model import resources as R
from kubegpu.model.annotations import GPU_MODEL, split_models
from kubegpu.model.legacy import LEGACY_AFFINITY, LegacyAffinityError
from kubegpu.model.legacy import translate as translate_legacy
from kubegpu.model.quantity import QuantityError, format_bytes, parse, parse_int

# Upper bounds that catch absurd quantities (typos such as "8000" GPUs) with a clear reason.
MAX_DEVICES_PER_CONTAINER = 64
MAX_GPU_MEMORY_BYTES = 2**40  # 1 TiB per GPU is beyond any GPU sold today


class RequestKind(StrEnum):
    WHOLE = "whole"  # nvidia.com/gpu: N
    MIG = "mig"  # nvidia.com/mig-<profile>: N
    REPLICA = "replica"  # time-slicing / MPS replicas: nvidia.com/gpu.shared (or renamed): N
    SHARE = "share"  # fine-grained: percent of compute plus memory, over `count` GPUs


@dataclass(frozen=True, slots=True)
class GpuRequest:
    """What one container asks for, normalised.

    For ``SHARE`` the amounts are per GPU: ``count`` GPUs each get ``core`` percent
    of compute and ``memory_bytes`` bytes or ``memory_ratio`` percent of memory
    (exactly one of the two memory forms is set). For ``WHOLE`` the GPU is
    exclusive (core 100, ratio 100).
    """

    kind: RequestKind
    count: int
    core: int = 100
    memory_bytes: int | None = None
    memory_ratio: int | None = 100
    resource: str = R.NVIDIA_GPU
    mig_profile: str | None = None

    @property
    def exclusive(self) -> bool:
        """True when each GPU it spans is taken whole (no one else may share it)."""
        if self.kind is RequestKind.WHOLE:
            return True
        return self.kind is RequestKind.SHARE and self.core == 100 and self.memory_ratio == 100

    def memory_on(self, gpu_memory_bytes: int) -> int:
        """Bytes this request takes on each GPU of the given size."""
        if self.kind is RequestKind.WHOLE or self.memory_bytes is None:
            return gpu_memory_bytes * (self.memory_ratio or 0) // 100
        return self.memory_bytes

    @property
    def gpu_milli(self) -> int:
        """Total GPU demand in thousandths of a GPU (compute), as the trace counts it."""
        if self.kind in (RequestKind.WHOLE, RequestKind.MIG, RequestKind.REPLICA):
            return 1000 * self.count
        return self.core * 10 * self.count


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused: container, resource, value and the rule it breaks."""

    container: str
    resource: str
    value: str
    rule: str
    # A short stable name of the rule ("whole-number", "combination", ...): metrics labels and tests.
    code: str = ""

    def __str__(self) -> str:
        where = f"container {self.container!r}" if self.container != "-" else "pod"
        tag = f" [{self.code}]" if self.code else ""
        if not self.resource:
            return f"{where}: {self.rule}{tag}"
        return f"{where}: {self.resource}={self.value!r}: {self.rule}{tag}"


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    """One container's GPU request and the canonical resources it normalises to.

    ``limits`` holds the canonical GPU entries the container should carry in
    both limits and requests (aliases rewritten, ``kubegpu.io/gpu`` expanded,
    ``kubegpu.io/gpu.shared`` added); ``renamed`` holds the alias names found in
    the spec (they are replaced by their canonical names). The webhook's patch is
    built by :func:`kubegpu.model.normalise.review_pod` from ``limits``.
    """

    name: str
    init: bool
    request: GpuRequest | None
    limits: Mapping[str, str] = field(default_factory=dict)
    renamed: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class PodRequest:
    containers: tuple[ContainerRequest, ...]
    refusals: tuple[Refusal, ...]
    allowed_models: frozenset[str] | None = None

    @property
    def ok(self) -> bool:
        return not self.refusals

    @property
    def gpu_containers(self) -> tuple[ContainerRequest, ...]:
        return tuple(c for c in self.containers if c.request is not None)

    @property
    def wants_gpu(self) -> bool:
        return any(c.request is not None for c in self.containers)


class _Refused(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal


def _refuse(container: str, resource: str, value: object, rule: str, code: str) -> _Refused:
    return _Refused(Refusal(container, resource, _text(value), rule, code))


def _text(value: object) -> str:
    return value if isinstance(value, str) else str(value)


def _gpu_entries(container: str, section: object, where: str,
                 replicas: frozenset[str]) -> dict[str, tuple[str, object]]:
    """Canonical name -> (name as written, value) for the GPU entries of limits or requests."""
    out: dict[str, tuple[str, object]] = {}
    if section is None:
        return out
    if not isinstance(section, Mapping):
        raise _refuse(container, f"resources.{where}", section, "must be a map", "not-a-map")
    for name, value in section.items():
        if not isinstance(name, str) or not R.is_gpu_resource(name, replicas):
            continue
        if not R.is_known_name(name, replicas):
            from kubegpu.model.names import suggest  # names reads this module's Refusal

            hit = suggest(name, replicas)
            raise _refuse(container, name, value,
                          (f"unknown GPU resource name; did you mean {hit!r}? (" if hit else
                           "unknown GPU resource name (") + "canonical: nvidia.com/gpu, "
                          f"nvidia.com/mig-<g>g.<m>gb, {', '.join(R.SHARE_RESOURCES)}; aliases: "
                          "kubernetes.io/gpu*, koordinator.sh/gpu*, alpha.kubernetes.io/nvidia-gpu)",
                          "unknown-resource")
        canon = R.canonical_name(name)
        if canon in out:
            # Name the alias (not the canonical spelling) and list both sorted, so the message
            # does not depend on the order of the map.
            (a, a_value), (b, _) = sorted([out[canon], (name, value)],
                                          key=lambda entry: (entry[0] == canon, entry[0]))
            raise _refuse(container, a, a_value, f"given twice in {where} (as {min(a, b)!r} and "
                          f"{max(a, b)!r})", "duplicate")
        out[canon] = (name, value)
    return out


def _count(container: str, name: str, value: object) -> int:
    try:
        n = parse_int(value)
    except QuantityError:
        raise _refuse(container, name, value, "must be a whole number (no fractions of a device)",
                      "whole-number") from None
    if n <= 0:
        raise _refuse(container, name, value, "must be at least 1", "not-positive")
    if n > MAX_DEVICES_PER_CONTAINER:
        raise _refuse(container, name, value,
                      f"more than {MAX_DEVICES_PER_CONTAINER} devices in one container", "too-large")
    return n


def _percent(container: str, name: str, value: object) -> int:
    try:
        p = parse_int(value)
    except QuantityError:
        raise _refuse(container, name, value, "must be a whole percent", "whole-number") from None
    if p <= 0:
        raise _refuse(container, name, value, "must be at least 1", "not-positive")
    if p > 100 * MAX_DEVICES_PER_CONTAINER:
        raise _refuse(container, name, value,
                      f"more than {MAX_DEVICES_PER_CONTAINER} GPUs in one container", "too-large")
    if p > 100 and p % 100:
        raise _refuse(container, name, value,
                      "is a percent of one GPU: 1..100, or a multiple of 100 (whole GPUs) above 100",
                      "percent-multiple")
    return p


def _bytes(container: str, name: str, value: object) -> int:
    try:
        b = parse_int(value)
    except QuantityError:
        raise _refuse(container, name, value, "must be a whole number of bytes (a quantity such as 8Gi)",
                      "whole-number") from None
    if b <= 0:
        raise _refuse(container, name, value, "must be at least 1 byte", "not-positive")
    if b > MAX_GPU_MEMORY_BYTES * MAX_DEVICES_PER_CONTAINER:
        raise _refuse(container, name, value, "more GPU memory than any node has", "too-large")
    return b


def _merge_limits_requests(container: str, resources: Mapping[str, Any],
                           replicas: frozenset[str]) -> dict[str, tuple[str, object]]:
    limits = _gpu_entries(container, resources.get("limits"), "limits", replicas)
    requests = _gpu_entries(container, resources.get("requests"), "requests", replicas)
    merged = dict(limits)
    for canon, (name, value) in requests.items():
        if canon in limits:
            _lname, lvalue = limits[canon]
            if _text(lvalue).strip() != _text(value).strip() and not _same_quantity(lvalue, value):
                raise _refuse(container, name, value, f"requests must equal limits ({_text(lvalue)!r})",
                              "requests-differ")
        elif canon not in R.SHARE_RESOURCES:
            # Device-plugin resources follow Kubernetes' rule for extended resources: limits are
            # required; the fine-grained share resources may be written in requests only (the seed's pods).
            raise _refuse(container, name, value, "must be set in limits (requests alone are refused)",
                          "requests-without-limits")
        else:
            merged[canon] = (name, value)
    return merged


def _same_quantity(a: object, b: object) -> bool:
    try:
        return parse(a) == parse(b)
    except QuantityError:
        return False


def _parse_share(container: str, entries: dict[str, tuple[str, object]]) -> tuple[GpuRequest, dict[str, str]]:
    def named(canon: str) -> tuple[str, object]:
        return entries[canon]

    present = set(entries)
    if R.GPU_PERCENT in present:
        # Alone, as the protocol's allowed combinations say: not even with gpu.shared.
        others = present & {R.GPU_CORE, R.GPU_MEMORY, R.GPU_MEMORY_RATIO, R.GPU_SLOTS}
        if others:
            name, value = named(R.GPU_PERCENT)
            raise _refuse(container, name, value,
                          f"{R.GPU_PERCENT} is shorthand for core + memory-ratio and cannot be "
                          f"combined with {', '.join(sorted(others))}", "combination")
    if R.GPU_MEMORY in present and R.GPU_MEMORY_RATIO in present:
        name, value = named(R.GPU_MEMORY)
        raise _refuse(container, name, value,
                      f"give one memory form: {R.GPU_MEMORY} or {R.GPU_MEMORY_RATIO}, not both",
                      "two-memory-forms")

    core = ratio = memory = None
    if R.GPU_PERCENT in present:
        core = ratio = _percent(container, *named(R.GPU_PERCENT))
    if R.GPU_CORE in present:
        core = _percent(container, *named(R.GPU_CORE))
    if R.GPU_MEMORY_RATIO in present:
        ratio = _percent(container, *named(R.GPU_MEMORY_RATIO))
    if R.GPU_MEMORY in present:
        memory = _bytes(container, *named(R.GPU_MEMORY))

    if ratio is None and memory is None:
        name, value = named(R.GPU_CORE) if R.GPU_CORE in present else named(R.GPU_SLOTS)
        raise _refuse(container, name, value,
                      f"a GPU share must declare memory: add {R.GPU_MEMORY} or {R.GPU_MEMORY_RATIO}",
                      "memory-missing")

    if R.GPU_SLOTS in present:
        k = _count(container, *named(R.GPU_SLOTS))
        for canon, total in ((R.GPU_CORE, core), (R.GPU_MEMORY_RATIO, ratio)):
            if total is None:
                continue
            name, value = named(canon) if canon in present else named(R.GPU_PERCENT)
            if total % k:
                raise _refuse(container, name, value, f"must divide evenly over {R.GPU_SLOTS}={k} GPUs",
                              "divisibility")
            if total // k > 100:
                raise _refuse(container, name, value,
                              f"is {total // k} % per GPU over {k} GPUs; at most 100 % per GPU",
                              "per-gpu-over-100")
        if memory is not None and memory % k:
            name, value = named(R.GPU_MEMORY)
            raise _refuse(container, name, value, f"must divide evenly over {R.GPU_SLOTS}={k} GPUs",
                          "divisibility")
    else:
        totals = ((R.GPU_CORE, core), (R.GPU_MEMORY_RATIO, ratio))
        spans = {canon: (total + 99) // 100 for canon, total in totals if total is not None}
        k = max(spans.values(), default=1)
        if len(set(spans.values())) > 1:
            name, value = named(R.GPU_CORE)
            raise _refuse(container, name, value,
                          f"core and memory-ratio span different numbers of GPUs "
                          f"({spans[R.GPU_CORE]} vs {spans[R.GPU_MEMORY_RATIO]}); "
                          f"set {R.GPU_SLOTS} to say how many GPUs to split over", "span-mismatch")
        if memory is not None and memory % k:
            name, value = named(R.GPU_MEMORY)
            raise _refuse(container, name, value, f"must divide evenly over {k} GPUs", "divisibility")
    if memory is not None and memory // k > MAX_GPU_MEMORY_BYTES:
        name, value = named(R.GPU_MEMORY)
        raise _refuse(container, name, value,
                      f"is {format_bytes(memory // k)} per GPU; no GPU has more than "
                      f"{format_bytes(MAX_GPU_MEMORY_BYTES)}", "too-large")

    req = GpuRequest(
        kind=RequestKind.SHARE,
        count=k,
        core=(core // k) if core is not None else 0,
        memory_bytes=(memory // k) if memory is not None else None,
        memory_ratio=(ratio // k) if ratio is not None else None,
        resource=R.GPU_SLOTS,
    )
    limits: dict[str, str] = {}
    if core is not None:
        limits[R.GPU_CORE] = str(core)
    if memory is not None:
        limits[R.GPU_MEMORY] = format_bytes(memory)
    if ratio is not None:
        limits[R.GPU_MEMORY_RATIO] = str(ratio)
    limits[R.GPU_SLOTS] = str(k)
    return req, limits


def _parse_container(name: str, resources: Mapping[str, Any], init: bool,
                     replicas: frozenset[str] = frozenset()) -> ContainerRequest:
    entries = _merge_limits_requests(name, resources, replicas)
    renamed = frozenset(orig for canon, (orig, _) in entries.items() if orig != canon)
    if not entries:
        return ContainerRequest(name, init, None)

    share = {c for c in entries if c in R.SHARE_RESOURCES}
    devices = {c for c in entries if c not in share}
    if share and devices:
        first = sorted(devices)[0]
        orig, value = entries[first]
        raise _refuse(name, orig, value,
                      f"cannot be combined with the fine-grained share resources "
                      f"({', '.join(sorted(share))}) in one container", "combination")
    if share:
        req, limits = _parse_share(name, entries)
        return ContainerRequest(name, init, req, limits, renamed)
    if len(devices) > 1:
        first, second = sorted(devices)[:2]
        orig, value = entries[second]
        raise _refuse(name, orig, value, f"one device resource per container; {first} is also requested",
                      "combination")
    (canon,) = devices
    orig, value = entries[canon]
    n = _count(name, orig, value)
    if canon == R.NVIDIA_GPU:
        req = GpuRequest(RequestKind.WHOLE, n, resource=R.NVIDIA_GPU)
    elif canon.startswith(R.NVIDIA_MIG_PREFIX) and not R.is_shared_mig_resource(canon):
        if not R.is_mig_resource(canon):
            raise _refuse(name, orig, value, "not a MIG profile name (expected nvidia.com/mig-<g>g.<m>gb)",
                          "mig-profile")
        req = GpuRequest(RequestKind.MIG, n, resource=canon, mig_profile=R.mig_profile(canon),
                         memory_ratio=None)
    else:
        # nvidia.com/gpu.shared, nvidia.com/mig-1g.10gb.shared (time-slicing's renameByDefault) or a
        # renamed replica resource such as nvidia.com/sharedgpu.
        req = GpuRequest(RequestKind.REPLICA, n, resource=canon, memory_ratio=None)
    return ContainerRequest(name, init, req, {canon: str(n)}, renamed)


def _container_name(container: object, i: int) -> str:
    name = container.get("name") if isinstance(container, Mapping) else None
    return name if isinstance(name, str) and name else f"#{i}"


def parse_pod(pod: Mapping[str, Any], *, replica_resources: frozenset[str] = frozenset()) -> PodRequest:
    """Parse every container and init container of a Pod (a dict shaped like a v1.Pod).

    ``replica_resources`` names renamed replica resources that :func:`R.is_nvidia_gpu_name`
    cannot recognise by their name (``nvidia.com/small``). Never raises on bad input:
    every problem becomes a :class:`Refusal`.
    """
    refusals: list[Refusal] = []
    containers: list[ContainerRequest] = []
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if not isinstance(spec, Mapping):
        return PodRequest((), (Refusal("-", "spec", "", "the pod has no spec", "no-spec"),))
    for key, init in (("initContainers", True), ("containers", False)):
        items = spec.get(key) or []
        if not isinstance(items, list):
            refusals.append(Refusal("-", f"spec.{key}", "", "must be a list", "not-a-map"))
            continue
        for i, c in enumerate(items):
            name = _container_name(c, i)
            if not isinstance(c, Mapping):
                refusals.append(Refusal(name, "", "", "container must be an object", "not-a-map"))
                continue
            resources = c.get("resources") or {}
            try:
                if not isinstance(resources, Mapping):
                    raise _refuse(name, "resources", resources, "must be an object", "not-a-map")
                containers.append(_parse_container(name, resources, init, replica_resources))
            except _Refused as r:
                refusals.append(r.refusal)
    allowed = None
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    if isinstance(annotations, Mapping) and isinstance(annotations.get(GPU_MODEL), str):
        allowed = split_models(annotations[GPU_MODEL]) or None
    elif isinstance(annotations, Mapping) and LEGACY_AFFINITY in annotations:
        # A pod that reached the scheduler untranslated (no webhook): the legacy GPU-name choice still holds.
        with contextlib.suppress(LegacyAffinityError):
            allowed = translate_legacy(annotations[LEGACY_AFFINITY]).models or None
    return PodRequest(tuple(containers), tuple(refusals), allowed)


def parse_resources(name: str, resources: Mapping[str, Any], *, init: bool = False,
                    replica_resources: frozenset[str] = frozenset()) -> ContainerRequest:
    """Parse one container's ``resources``; raises :class:`RequestRefused` when refused."""
    try:
        return _parse_container(name, resources, init, replica_resources)
    except _Refused as r:
        raise RequestRefused(r.refusal) from None


class RequestRefused(ValueError):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal
