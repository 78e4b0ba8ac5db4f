"""The rules that live in ``model``: Kubernetes' init-container rule, record signatures, hostile records."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubegpu.model import signing
from kubegpu.model.allocation import AnnotationError, ContainerAllocation, DeviceGrant, PodAllocation, decode, encode


def g(uuid: str, core: int, mem: int = 0, mig: str | None = None) -> DeviceGrant:
    return DeviceGrant(0, uuid, core, mem, core, mig, "1g.10gb" if mig else None)


def test_init_containers_count_as_the_larger_of_the_largest_init_and_the_sum_of_apps() -> None:
    alloc = PodAllocation((ContainerAllocation("init", (g("A", 80, 8),), init=True),
                           ContainerAllocation("app", (g("A", 20, 2),))))
    held = alloc.held().grants()
    assert [(x.uuid, x.core, x.memory_bytes) for x in held] == [("A", 80, 8)]  # not 100 (the 80 % case)
    apps = PodAllocation((ContainerAllocation("i1", (g("A", 50, 1), g("B", 10)), init=True),
                          ContainerAllocation("i2", (g("A", 40, 9),), init=True),
                          ContainerAllocation("a1", (g("A", 30, 3),)), ContainerAllocation("a2", (g("A", 30, 3),)),
                          ContainerAllocation("m", (g("P", 14, 5, mig="MIG-1"),))))
    by = {(x.mig_uuid or x.uuid): x for x in apps.held().grants()}
    assert (by["A"].core, by["A"].memory_bytes) == (60, 9)  # per dimension: max(50, 40, 30+30), max(1, 9, 6)
    assert by["B"].core == 10 and by["MIG-1"].mig_uuid == "MIG-1"
    plain = PodAllocation((ContainerAllocation("a", (g("A", 30),)),))
    assert plain.held() is plain


def test_init_flag_round_trips_through_the_annotation() -> None:
    alloc = PodAllocation((ContainerAllocation("i", (g("A", 100),), init=True),
                           ContainerAllocation("a", (g("A", 100),))))
    assert decode(encode(alloc)) == alloc
    single = PodAllocation((ContainerAllocation("i", (g("A", 20),), init=True),))
    assert decode(encode(single)) == single


def test_hostile_records_are_refused_not_raised() -> None:
    with pytest.raises(AnnotationError, match=r"nested too deeply|not JSON"):
        decode("[" * 100000)
    with pytest.raises(AnnotationError, match="more than any record"):
        decode(" " * (1 << 20))


def test_signatures_bind_the_record_to_its_pod_and_node(tmp_path: Path) -> None:
    key = b"0123456789abcdef0123"
    sig = signing.sign(key, "uid-1", "node-a", "{}")
    assert signing.verify(key, "uid-1", "node-a", "{}", sig)
    assert not signing.verify(key, "uid-2", "node-a", "{}", sig)  # copied onto another pod
    assert not signing.verify(key, "uid-1", "node-b", "{}", sig)  # another node
    assert not signing.verify(key, "uid-1", "node-a", '{"x":1}', sig)
    assert not signing.verify(key, "uid-1", "node-a", "{}", sig, kind="ack")  # a record is not an ack
    assert not signing.verify(key, "uid-1", "node-a", "{}", "nope")
    f = tmp_path / "key"
    f.write_text("k" * 32 + "\n")
    assert signing.load_key({signing.KEY_FILE_ENV: str(f)}) == b"k" * 32
    assert signing.load_key({}) is None
    with pytest.raises(signing.RecordKeyError, match="at least 16 bytes"):
        signing.load_key({signing.KEY_ENV: "short"})
    with pytest.raises(signing.RecordKeyError, match="cannot read"):
        signing.load_key({signing.KEY_FILE_ENV: str(tmp_path / "missing")})
    ann = signing.record_annotations("{}", "uid-1", "node-a", key)
    assert signing.verify(key, "uid-1", "node-a", "{}", ann[signing.RECORD_SIGNATURE])
