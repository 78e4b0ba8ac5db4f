"""Every rule of the resource protocol (ARCHITECTURE.md), one table row each: accepted requests
with their normalised form, refused requests with the rule they break."""

from __future__ import annotations

from typing import Any

import pytest

from kubegpu.model import RequestKind, RequestRefused, parse_pod, parse_resources
from kubegpu.model import resources as R

GI = 2**30
CORE, MEM, RATIO, PCT, SLOTS = R.GPU_CORE, R.GPU_MEMORY, R.GPU_MEMORY_RATIO, R.GPU_PERCENT, R.GPU_SLOTS
MIG = "nvidia.com/mig-1g.10gb"


def pod(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers)}
    if init:
        spec["initContainers"] = list(init)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}


def ctr(name: str = "main", limits: dict[str, Any] | None = None,
        requests: dict[str, Any] | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if limits is not None:
        res["limits"] = limits
    if requests is not None:
        res["requests"] = requests
    return {"name": name, "image": "busybox", "resources": res}


# (id, limits, requests, kind, count, core/GPU, memory bytes/GPU, ratio/GPU, canonical limits)
ACCEPTED = [
    ("whole-1", {"nvidia.com/gpu": 1}, None, "whole", 1, 100, None, 100, {"nvidia.com/gpu": "1"}),
    ("whole-str", {"nvidia.com/gpu": "4"}, None, "whole", 4, 100, None, 100, {"nvidia.com/gpu": "4"}),
    ("whole-req-eq", {"nvidia.com/gpu": "2"}, {"nvidia.com/gpu": 2}, "whole", 2, 100, None, 100,
     {"nvidia.com/gpu": "2"}),
    ("whole-exp", {"nvidia.com/gpu": "1e1"}, None, "whole", 10, 100, None, 100, {"nvidia.com/gpu": "10"}),
    ("alpha-alias", {"alpha.kubernetes.io/nvidia-gpu": 2}, None, "whole", 2, 100, None, 100,
     {"nvidia.com/gpu": "2"}),
    ("mig", {MIG: 1}, None, "mig", 1, 100, None, None, {MIG: "1"}),
    ("mig-me", {"nvidia.com/mig-1g.10gb+me": 2}, None, "mig", 2, 100, None, None,
     {"nvidia.com/mig-1g.10gb+me": "2"}),
    ("mig-ci", {"nvidia.com/mig-1c.3g.40gb": 1}, None, "mig", 1, 100, None, None,
     {"nvidia.com/mig-1c.3g.40gb": "1"}),
    ("replica", {"nvidia.com/gpu.shared": 2}, None, "replica", 2, 100, None, None,
     {"nvidia.com/gpu.shared": "2"}),
    ("replica-mig-shared", {"nvidia.com/mig-1g.10gb.shared": 2}, None, "replica", 2, 100, None, None,
     {"nvidia.com/mig-1g.10gb.shared": "2"}),
    ("replica-renamed", {"nvidia.com/sharedgpu": 1}, None, "replica", 1, 100, None, None,
     {"nvidia.com/sharedgpu": "1"}),
    ("percent", {PCT: "50"}, None, "share", 1, 50, None, 50,
     {CORE: "50", RATIO: "50", SLOTS: "1"}),
    ("percent-200", {PCT: "200"}, None, "share", 2, 100, None, 100,
     {CORE: "200", RATIO: "200", SLOTS: "2"}),
    ("memory-alone", {MEM: "8Gi"}, None, "share", 1, 0, 8 * GI, None,
     {MEM: "8Gi", SLOTS: "1"}),
    ("memory-mi", {MEM: "16384Mi"}, None, "share", 1, 0, 16 * GI, None,
     {MEM: "16Gi", SLOTS: "1"}),
    ("memory-decimal", {MEM: "500M"}, None, "share", 1, 0, 500_000_000, None,
     {MEM: "500000000", SLOTS: "1"}),
    ("ratio-alone", {RATIO: 25}, None, "share", 1, 0, None, 25,
     {RATIO: "25", SLOTS: "1"}),
    ("core-ratio", {CORE: 30, RATIO: 40}, None, "share", 1, 30, None, 40,
     {CORE: "30", RATIO: "40", SLOTS: "1"}),
    ("core-memory", {CORE: "100", MEM: "16Mi"}, None, "share", 1, 100,
     16 * 2**20, None,
     {CORE: "100", MEM: "16Mi", SLOTS: "1"}),
    ("core-ratio-200", {CORE: 200, RATIO: 200}, None, "share", 2, 100,
     None, 100,
     {CORE: "200", RATIO: "200", SLOTS: "2"}),
    ("core-memory-200", {CORE: 200, MEM: "32Gi"}, None, "share", 2, 100,
     16 * GI, None,
     {CORE: "200", MEM: "32Gi", SLOTS: "2"}),
    ("shared-k2", {CORE: 100, RATIO: 60, SLOTS: 2},
     None, "share", 2, 50, None, 30,
     {CORE: "100", RATIO: "60", SLOTS: "2"}),
    ("shared-memory-only", {MEM: "16Gi", SLOTS: 4}, None, "share", 4, 0,
     4 * GI, None, {MEM: "16Gi", SLOTS: "4"}),
    ("shared-full-each", {CORE: 200, RATIO: 200,
                          SLOTS: 2}, None, "share", 2, 100, None, 100,
     {CORE: "200", RATIO: "200", SLOTS: "2"}),
    # The seeds' fine-grained style: requests only, copied into limits.
    ("requests-only-share", None, {"kubernetes.io/gpu": "100"}, "share", 1, 100, None, 100,
     {CORE: "100", RATIO: "100", SLOTS: "1"}),
    ("split-limits-requests", {CORE: 50}, {MEM: "4Gi"}, "share", 1, 50,
     4 * GI, None, {CORE: "50", MEM: "4Gi", SLOTS: "1"}),
    ("alias-and-canonical-equal", {CORE: 50, RATIO: 50},
     {"kubernetes.io/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50"}, "share", 1, 50, None, 50,
     {CORE: "50", RATIO: "50", SLOTS: "1"}),
    ("equal-quantities", {MEM: "1Gi"}, {MEM: "1024Mi"}, "share", 1, 0,
     GI, None, {MEM: "1Gi", SLOTS: "1"}),
    ("other-resources-ignored", {"nvidia.com/gpu": 1, "cpu": "2", "memory": "1Gi",
                                 "nvidia.com/rdma_shared_device_a": 1, "example.com/foo": 3},
     None, "whole", 1, 100, None, 100, {"nvidia.com/gpu": "1"}),
]


@pytest.mark.parametrize("case", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_accepted_requests_normalise(case: tuple[Any, ...]) -> None:
    _id, limits, requests, kind, count, core, mem, ratio, canon = case
    c = parse_resources("main", {"limits": limits, "requests": requests})
    assert c.request is not None
    r = c.request
    assert (str(r.kind), r.count) == (kind, count)
    if r.kind is RequestKind.SHARE:
        assert (r.core, r.memory_bytes, r.memory_ratio) == (core, mem, ratio)
        assert r.resource == R.GPU_SLOTS
    assert dict(c.limits) == canon


# Every alias, alone, to its canonical name.
ALIAS_CASES = [
    ("alpha.kubernetes.io/nvidia-gpu", "1", {"nvidia.com/gpu": "1"}),
    ("kubernetes.io/gpu", "50", {R.GPU_CORE: "50", R.GPU_MEMORY_RATIO: "50", R.GPU_SLOTS: "1"}),
    ("kubernetes.io/gpu-memory", "2Gi", {R.GPU_MEMORY: "2Gi", R.GPU_SLOTS: "1"}),
    ("kubernetes.io/gpu-memory-ratio", "20", {R.GPU_MEMORY_RATIO: "20", R.GPU_SLOTS: "1"}),
    ("koordinator.sh/gpu", "100", {R.GPU_CORE: "100", R.GPU_MEMORY_RATIO: "100", R.GPU_SLOTS: "1"}),
    ("koordinator.sh/gpu-memory", "2Gi", {R.GPU_MEMORY: "2Gi", R.GPU_SLOTS: "1"}),
    ("koordinator.sh/gpu-memory-ratio", "20", {R.GPU_MEMORY_RATIO: "20", R.GPU_SLOTS: "1"}),
]


@pytest.mark.parametrize(("name", "value", "canon"), ALIAS_CASES, ids=[a[0] for a in ALIAS_CASES])
def test_every_alias_rewrites_to_canonical(name: str, value: str, canon: dict[str, str]) -> None:
    c = parse_resources("main", {"limits": {name: value}})
    assert dict(c.limits) == canon
    assert c.renamed == frozenset({name})


@pytest.mark.parametrize("prefix", ["kubernetes.io", "koordinator.sh"])
def test_core_aliases_and_shared_alias(prefix: str) -> None:
    c = parse_resources("main", {"limits": {f"{prefix}/gpu-core": "40", f"{prefix}/gpu-memory-ratio": "40"}})
    assert dict(c.limits) == {R.GPU_CORE: "40", R.GPU_MEMORY_RATIO: "40", R.GPU_SLOTS: "1"}
    c = parse_resources("main", {"limits": {"koordinator.sh/gpu.shared": "2", f"{prefix}/gpu-memory": "2Gi"}})
    assert dict(c.limits) == {R.GPU_MEMORY: "2Gi", R.GPU_SLOTS: "2"}


def test_every_alias_is_in_the_table() -> None:
    tested = {a[0] for a in ALIAS_CASES} | {"kubernetes.io/gpu-core", "koordinator.sh/gpu-core",
                                           "koordinator.sh/gpu.shared"}
    assert tested == set(R.ALIASES)


# (id, limits, requests, refused resource, code, words in the rule)
REFUSED = [
    ("gpu-fraction", {"nvidia.com/gpu": "0.5"}, None, "nvidia.com/gpu", "whole-number", "whole number"),
    ("gpu-milli", {"nvidia.com/gpu": "500m"}, None, "nvidia.com/gpu", "whole-number", "whole number"),
    ("gpu-almost-two", {"nvidia.com/gpu": "1.9999"}, None, "nvidia.com/gpu", "whole-number", "whole"),
    ("gpu-zero", {"nvidia.com/gpu": 0}, None, "nvidia.com/gpu", "not-positive", "at least 1"),
    ("gpu-negative", {"nvidia.com/gpu": "-1"}, None, "nvidia.com/gpu", "not-positive", "at least 1"),
    ("gpu-absurd", {"nvidia.com/gpu": 8000}, None, "nvidia.com/gpu", "too-large", "more than 64"),
    ("gpu-garbage", {"nvidia.com/gpu": "two"}, None, "nvidia.com/gpu", "whole-number", "whole number"),
    ("gpu-bool", {"nvidia.com/gpu": True}, None, "nvidia.com/gpu", "whole-number", "whole number"),
    ("gpu-huge-exponent", {"nvidia.com/gpu": "1e999999999"}, None, "nvidia.com/gpu", "whole-number", "whole"),
    ("alpha-fraction", {"alpha.kubernetes.io/nvidia-gpu": "1.5"}, None, "alpha.kubernetes.io/nvidia-gpu",
     "whole-number", "whole number"),
    ("mig-fraction", {MIG: "0.5"}, None, MIG, "whole-number", "whole"),
    ("mig-zero", {MIG: "0"}, None, MIG, "not-positive", "at least"),
    ("mig-bad-profile", {"nvidia.com/mig-big": 1}, None, "nvidia.com/mig-big", "mig-profile", "MIG profile"),
    ("replica-fraction", {"nvidia.com/gpu.shared": "0.5"}, None, "nvidia.com/gpu.shared", "whole-number",
     "whole"),
    ("gpu-requests-only", None, {"nvidia.com/gpu": 1}, "nvidia.com/gpu", "requests-without-limits",
     "must be set in limits"),
    ("mig-requests-only", None, {MIG: 1}, MIG,
     "requests-without-limits", "limits"),
    ("gpu-requests-differ", {"nvidia.com/gpu": 2}, {"nvidia.com/gpu": 1}, "nvidia.com/gpu", "requests-differ",
     "requests must equal limits"),
    ("share-requests-differ", {PCT: 50}, {"kubernetes.io/gpu": 60}, "kubernetes.io/gpu",
     "requests-differ", "equal limits"),
    ("core-alone", {CORE: 50}, None, CORE, "memory-missing",
     "must declare memory"),
    ("shared-alone", {SLOTS: 1}, None, SLOTS, "memory-missing",
     "must declare memory"),
    ("core-shared-no-memory", {CORE: 50, SLOTS: 1}, None,
     CORE, "memory-missing", "memory"),
    ("two-memory-forms", {MEM: "1Gi", RATIO: 10}, None,
     MEM, "two-memory-forms", "not both"),
    ("percent-with-core", {PCT: 50, CORE: 50}, None, PCT,
     "combination", "shorthand"),
    ("percent-with-memory", {PCT: 50, MEM: "1Gi"}, None, PCT,
     "combination", "shorthand"),
    ("percent-with-ratio", {PCT: 50, RATIO: 50}, None, PCT,
     "combination", "shorthand"),
    ("share-with-whole", {"nvidia.com/gpu": 1, PCT: 50}, None, "nvidia.com/gpu", "combination",
     "cannot be combined"),
    ("share-with-mig", {MIG: 1, MEM: "1Gi"}, None,
     MIG, "combination", "cannot be combined"),
    ("two-devices", {"nvidia.com/gpu": 1, MIG: 1}, None, MIG,
     "combination", "one device resource"),
    ("alias-twice", {"nvidia.com/gpu": 1, "alpha.kubernetes.io/nvidia-gpu": 1}, None,
     "alpha.kubernetes.io/nvidia-gpu", "duplicate", "given twice"),
    ("percent-zero", {PCT: 0}, None, PCT, "not-positive", "at least 1"),
    ("core-zero", {CORE: 0, RATIO: 10}, None, CORE,
     "not-positive", "at least 1"),
    ("ratio-zero", {RATIO: "0"}, None, RATIO, "not-positive",
     "at least 1"),
    ("memory-zero", {MEM: "0"}, None, MEM, "not-positive", "1 byte"),
    ("shared-zero", {MEM: "1Gi", SLOTS: 0}, None, SLOTS,
     "not-positive", "at least 1"),
    ("percent-150", {PCT: 150}, None, PCT, "percent-multiple", "multiple of 100"),
    ("core-101", {CORE: 101, RATIO: 101}, None, CORE,
     "percent-multiple", "multiple of 100"),
    ("ratio-250", {RATIO: 250}, None, RATIO, "percent-multiple",
     "multiple of 100"),
    ("percent-fraction", {PCT: "12.5"}, None, PCT, "whole-number", "whole percent"),
    ("percent-absurd", {PCT: 100000}, None, PCT, "too-large", "GPUs in one"),
    ("memory-fraction", {MEM: "0.5"}, None, MEM, "whole-number",
     "bytes"),
    ("memory-garbage", {MEM: "8GB"}, None, MEM, "whole-number", "bytes"),
    ("memory-absurd", {MEM: "2Ei"}, None, MEM, "too-large",
     "more GPU memory"),
    ("memory-per-gpu-absurd", {MEM: "2Ti"}, None, MEM, "too-large",
     "per GPU"),
    ("shared-core-indivisible", {CORE: 50, RATIO: 60,
                                 SLOTS: 3}, None, CORE, "divisibility",
     "divide evenly"),
    ("shared-ratio-indivisible", {RATIO: 25, SLOTS: 2}, None,
     RATIO, "divisibility", "divide evenly"),
    # The protocol's allowed combinations: kubegpu.io/gpu alone; gpu.shared goes with a memory form.
    ("percent-with-shared", {PCT: 100, SLOTS: 2}, None, PCT,
     "combination", "shorthand"),
    ("shared-memory-indivisible", {MEM: "1025", SLOTS: 2}, None,
     MEM, "divisibility", "divide evenly"),
    ("shared-over-100-per-gpu", {CORE: 400, RATIO: 400,
                                 SLOTS: 2}, None, CORE, "per-gpu-over-100",
     "at most 100 % per GPU"),
    ("span-mismatch", {CORE: 200, RATIO: 50}, None,
     CORE, "span-mismatch", "different numbers of GPUs"),
    ("memory-indivisible-over-span", {CORE: 300, MEM: "10Gi"}, None,
     MEM, "divisibility", "divide evenly over 3"),
    ("unknown-kubegpu", {"kubegpu.io/gpu-mem": "1Gi"}, None, "kubegpu.io/gpu-mem", "unknown-resource",
     "unknown GPU resource"),
    ("unknown-seed-alias", {"kubernetes.io/gpu-mem": "1Gi"}, None, "kubernetes.io/gpu-mem",
     "unknown-resource",
     "unknown GPU resource"),
    ("unknown-koordinator", {"koordinator.sh/gpu-cores": 1}, None, "koordinator.sh/gpu-cores",
     "unknown-resource", "unknown"),
    ("limits-not-a-map", ["nvidia.com/gpu"], None, "resources.limits", "not-a-map", "must be a map"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_requests_name_container_resource_value_and_rule(case: tuple[Any, ...]) -> None:
    _id, limits, requests, resource, code, words = case
    with pytest.raises(RequestRefused) as info:
        parse_resources("trainer", {"limits": limits, "requests": requests})
    r = info.value.refusal
    assert (r.container, r.resource, r.code) == ("trainer", resource, code)
    assert words in r.rule
    message = str(r)
    assert "trainer" in message and resource in message and r.rule in message
    if resource.count("/"):
        assert r.value != ""  # the value as written is in the message


def test_parse_pod_collects_refusals_of_every_container_and_init_container() -> None:
    p = pod(ctr("a", {"nvidia.com/gpu": "0.5"}), ctr("b", {CORE: 10}),
            ctr("ok", {"nvidia.com/gpu": 1}), init=(ctr("setup", {PCT: 150}),))
    parsed = parse_pod(p)
    assert not parsed.ok
    assert [(r.container, r.code) for r in parsed.refusals] == [
        ("setup", "percent-multiple"), ("a", "whole-number"), ("b", "memory-missing")]
    assert [c.name for c in parsed.gpu_containers] == ["ok"]


def test_init_containers_are_parsed_and_marked() -> None:
    parsed = parse_pod(pod(ctr("main"), init=(ctr("warmup", {"nvidia.com/gpu": 1}),)))
    assert parsed.ok and parsed.wants_gpu
    (c,) = parsed.gpu_containers
    assert c.init and c.name == "warmup"


def test_plain_pod_has_no_gpu_request() -> None:
    parsed = parse_pod(pod(ctr("web", {"cpu": "1", "memory": "1Gi"}, {"cpu": "500m"})))
    assert parsed.ok and not parsed.wants_gpu
    assert parsed.containers[0].request is None


@pytest.mark.parametrize("bad", [
    None, {}, {"spec": None}, {"spec": "x"}, {"spec": {"containers": "x"}}, {"spec": {"containers": ["x"]}},
    {"spec": {"containers": [{"name": "a", "resources": "x"}]}},
    {"spec": {"containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpu": None}}}]}},
    {"spec": {"containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpu": {"x": 1}}}}]}},
])
def test_malformed_pods_give_refusals_never_exceptions(bad: Any) -> None:
    parsed = parse_pod(bad)
    assert not parsed.ok
    assert all(isinstance(str(r), str) for r in parsed.refusals)


def test_non_gpu_nvidia_resources_are_not_gpus() -> None:
    c = parse_resources("net", {"limits": {"nvidia.com/rdma_shared_device_a": 1, "nvidia.com/hostdev": 2}})
    assert c.request is None


def test_declared_replica_resource_without_gpu_in_its_name() -> None:
    assert parse_resources("m", {"limits": {"nvidia.com/small": 1}}).request is None
    small = frozenset({"nvidia.com/small"})
    c = parse_resources("m", {"limits": {"nvidia.com/small": 1}}, replica_resources=small)
    assert c.request is not None and c.request.kind is RequestKind.REPLICA
    assert c.request.resource == "nvidia.com/small"
    parsed = parse_pod(pod(ctr("m", {"nvidia.com/small": 2})), replica_resources=small)
    assert parsed.gpu_containers[0].request.count == 2  # type: ignore[union-attr]


def test_allowed_models_from_annotation() -> None:
    p = pod(ctr("m", {"nvidia.com/gpu": 1}))
    p["metadata"]["annotations"] = {"kubegpu.io/gpu-model": "V100M16| A100 ,"}
    assert parse_pod(p).allowed_models == frozenset({"V100M16", "A100"})
    assert parse_pod(pod(ctr("m", {"nvidia.com/gpu": 1}))).allowed_models is None


def test_unnamed_containers_are_named_by_position() -> None:
    parsed = parse_pod({"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "x"}}}]}})
    assert parsed.refusals[0].container == "#0"


def test_share_request_accessors() -> None:
    c = parse_resources("m", {"limits": {PCT: 50}})
    assert c.request is not None
    assert c.request.gpu_milli == 500 and not c.request.exclusive
    assert c.request.memory_on(16 * GI) == 8 * GI
    whole = parse_resources("m", {"limits": {"nvidia.com/gpu": 2}}).request
    assert whole is not None and whole.exclusive and whole.gpu_milli == 2000
    assert whole.memory_on(16 * GI) == 16 * GI
