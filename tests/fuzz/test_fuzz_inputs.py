"""Issue 12 item 3 and "malformed input of any depth or size": property tests (bounded, fast) on every
reader of outside input that is not an HTTP server (those are in test_fuzz_http.py): the record codec,
the extender's wire decoders, the admission review, the node config loader, the YAML manifest and
topology loaders and the trace CSV reader. Each either returns or raises its own error type; never
RecursionError, OverflowError, TypeError or anything else."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kubegpu.inventory.topology import TopologyError, load_topology
from kubegpu.model.allocation import AnnotationError, ContainerAllocation, DeviceGrant, PodAllocation, decode, encode
from kubegpu.model.manifests import ManifestError, load_documents
from kubegpu.node.config import ConfigError, load_config, read_config_file
from kubegpu.scheduler.wire import WireError, decode_args, decode_binding
from kubegpu.sim.trace import TraceError, load_nodes, load_pods
from kubegpu.webhook.review import BadReview, read_review

F = TypeVar("F", bound=Callable[..., Any])
FAST = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))

# Deep and wide shapes that once raised RecursionError, and their YAML/JSON cousins.
DEEP = ["[" * 100_000, "{\"a\":" * 50_000, "[" * 5000 + "]" * 5000, "{a: " * 5000, "- " * 5000 + "x",
        "&a [*a, *a, *a]", "[" * 999 + "1" + "]" * 999, "- " * 100_000 + "x", "[" * 30_000 + "]" * 30_000,
        "a: [" + "[" * 40_000]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=25)
# The deep shapes are fixed inputs, so each test runs every one of them once as an explicit example
# (with_deep) rather than drawing them again and again at random (some take over a second to refuse).
text_or_deep = st.text(max_size=300) | json_values.map(json.dumps)


def with_deep(arg: str = "", encode: bool = False) -> Callable[[F], F]:
    """Every DEEP input as an explicit example (for ``arg`` by name, else positionally; bytes with ``encode``)."""

    def apply(test: F) -> F:
        for text in DEEP:
            value: str | bytes = text.encode() if encode else text
            test = example(**{arg: value})(test) if arg else example(value)(test)
        return test

    return apply


# ---- the record codec ---------------------------------------------------------------------------
grant = st.builds(DeviceGrant, minor=st.integers(0, 64), uuid=st.text(max_size=12),
                  core=st.integers(0, 100), memory_bytes=st.integers(0, 2**40), memory_ratio=st.integers(0, 100))
allocation = st.builds(PodAllocation, st.lists(
    st.builds(ContainerAllocation, st.text(min_size=1, max_size=8), st.lists(grant, max_size=3).map(tuple)),
    min_size=2, max_size=3, unique_by=lambda c: c.container).map(tuple))


@FAST
@with_deep()
@given(text_or_deep)
def test_record_decoder_returns_or_says_why(text: str) -> None:
    try:
        out = decode(text)
    except AnnotationError as e:
        assert len(str(e)) < 300_000
        return
    assert isinstance(out, PodAllocation)


def test_record_decoder_refuses_deep_and_huge_records() -> None:
    for text in DEEP[:2]:
        with pytest.raises(AnnotationError):
            decode(text)
    with pytest.raises(AnnotationError, match="more than any record"):
        decode('{"gpu": [' + ",".join(['{"minor": 0}'] * 40_000) + "]}")


@FAST
@given(allocation)
def test_record_round_trips(alloc: PodAllocation) -> None:
    assert decode(encode(alloc)) == alloc


# ---- HTTP body decoders -------------------------------------------------------------------------
@FAST
@with_deep(encode=True)
@given(text_or_deep.map(str.encode) | st.binary(max_size=200))
def test_extender_decoders_raise_only_wire_error(body: bytes) -> None:
    for fn in (decode_args, decode_binding):
        with contextlib.suppress(WireError):
            fn(body)


@FAST
@with_deep(encode=True)
@given(text_or_deep.map(str.encode) | st.binary(max_size=200))
def test_admission_review_reader_raises_only_bad_review(body: bytes) -> None:
    with contextlib.suppress(BadReview):
        read_review(body)


@pytest.mark.parametrize("body", [b'"\x80"', b'{"Pod": {"metadata": {"name": "\x80"}}}', b'{"NodeNames": ["\xff"]}'])
def test_bodies_with_invalid_utf8_strings_are_clear_errors(body: bytes) -> None:
    """msgspec raises UnicodeDecodeError (not DecodeError) for such strings; the random fuzz finds it only
    sometimes, so the shapes that reach it are pinned here."""
    with pytest.raises(WireError, match=r"UTF-8|Expected"):
        decode_args(body)
    with pytest.raises(WireError):  # unknown fields are skipped unread: a missing field is the error then
        decode_binding(body)
    with pytest.raises(BadReview, match="UTF-8"):
        read_review(body)


def test_deep_bodies_are_clear_errors() -> None:
    for text in DEEP[:2]:
        with pytest.raises(WireError, match=r"nested too deeply|not an ExtenderArgs"):
            decode_args(('{"Pod": ' + text).encode())
        with pytest.raises(BadReview):
            read_review(('{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": '
                         + text).encode())


# ---- files: node config, manifests, topology, trace CSV -----------------------------------------
@FAST
@with_deep("text")
@given(text=text_or_deep)
def test_node_config_file_loads_or_says_why(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("cfg") / "config.yaml"
    path.write_text(text)
    try:
        doc = read_config_file(path)
    except ConfigError:
        return
    with contextlib.suppress(ConfigError):
        load_config(file=doc)


config_keys = st.sampled_from(["version", "flags", "sharing", "resources", "migStrategy", "failOnInitError",
                               "plugin", "deviceListStrategy", "timeSlicing", "replicas", "mps", "kubegpu",
                               "imex", "rename", "devices", "name", "pattern", "gfd"])
config_docs = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**12) | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(config_keys, inner, max_size=4), max_leaves=20)


@FAST
@given(doc=st.dictionaries(config_keys, config_docs, max_size=4))
def test_node_config_documents_load_or_say_why(doc: dict[str, Any]) -> None:
    with contextlib.suppress(ConfigError):
        load_config(file=doc)


def test_manifests_nested_beyond_libyamls_stack_are_an_error_not_a_crash() -> None:
    # libyaml (C) overflows its stack on these: a segfault of `kubegpu check` before the guard.
    for text in ("[" * 100_000, "- " * 100_000 + "x", "a: [" + "[" * 40_000, "[" * 30_000 + "]" * 30_000):
        with pytest.raises(ManifestError, match=r"nested too deeply|not valid"):
            load_documents(text)
    assert load_documents('{"kind": "Pod"}') == [{"kind": "Pod"}]
    assert load_documents("[1, [2]]\n") == [[1, [2]]]
    assert load_documents("a: 1\n---\nb: [x, {c: d}]\n") == [{"a": 1}, {"b": ["x", {"c": "d"}]}]


@FAST
@with_deep("text")
@given(text=text_or_deep)
def test_manifests_load_or_say_why(text: str) -> None:
    with contextlib.suppress(ManifestError):
        load_documents(text)


@FAST
@with_deep("text")
@given(text=text_or_deep)
def test_topology_files_load_or_say_why(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("topo") / "t.yaml"
    path.write_text(text)
    with contextlib.suppress(TopologyError):
        load_topology(path)


csv_cells = st.sampled_from(["", "1", "0", "-1", "1.5", "1.0e999", "nan", "inf", "9" * 5000, "abc", "8000",
                             "\"q\"", "1e3", "100000000000000000000"])


@FAST
@given(rows=st.lists(st.lists(csv_cells, min_size=0, max_size=8), max_size=6),
       header=st.sampled_from(["sn,cpu_milli,memory_mib,gpu,model",
                               "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,creation_time,deletion_time",
                               "x", ""]), raw=st.text(max_size=200) | st.just("a" * 200_000))
def test_trace_csv_loads_or_says_why(tmp_path_factory: pytest.TempPathFactory, rows: list[list[str]], header: str,
                                     raw: str) -> None:
    d = tmp_path_factory.mktemp("trace")
    for name, text in (("rows.csv", "\n".join([header, *(",".join(r) for r in rows)])),
                       ("raw.csv", header + "\n" + raw)):
        p: Path = d / name
        p.write_text(text)
        for loader in (load_nodes, load_pods):
            with contextlib.suppress(TraceError):
                loader(p)


def test_trace_numbers_that_overflow_are_a_trace_error(tmp_path: Path) -> None:
    p = tmp_path / "nodes.csv"
    p.write_text("sn,cpu_milli,memory_mib,gpu\nn1,1.0e999,1,1\n")
    with pytest.raises(TraceError, match="is not a number"):
        load_nodes(p)


def test_extender_refuses_names_no_kubernetes_object_can_have() -> None:
    long = "n" * 254
    with pytest.raises(WireError, match="longer than 253"):
        decode_binding(json.dumps({"PodName": long, "PodNamespace": "d", "Node": "n"}).encode())
    with pytest.raises(WireError, match="longer than 253"):
        decode_args(json.dumps({"Pod": {}, "NodeNames": ["ok", long]}).encode())
    assert decode_binding(json.dumps({"PodName": "p" * 253, "PodNamespace": "d", "Node": "n"}).encode())


@FAST
@with_deep()
@given(text_or_deep)
def test_acknowledgement_and_legacy_affinity_readers_return_or_say_why(text: str) -> None:
    from kubegpu.model.legacy import LegacyAffinityError, translate
    from kubegpu.model.records import decode_acks

    with contextlib.suppress(AnnotationError):
        decode_acks(text)
    with contextlib.suppress(LegacyAffinityError):
        translate(text)
