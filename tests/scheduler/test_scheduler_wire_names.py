"""Issue 23: kube-scheduler's node lists recognised by their bytes (wire.NameMemo) decode to exactly what a
full decode gives, whatever the list: windows and rotations of the held list, other spellings, lists that
only look like windows, hostile names."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubegpu.scheduler.wire import MAX_NAME, HostPriority, NameMemo, WireError, decode_args, encode_priorities

NODES = [f"node-{i:03d}" for i in range(40)]


def body(names: list[str], spelling: str = "msgspec") -> bytes:
    pod: dict[str, object] = {"metadata": {"name": "p"}}
    if spelling == "msgspec":
        return msgspec.json.encode({"Pod": pod, "Nodes": None, "NodeNames": names})
    return json.dumps({"Pod": pod, "Nodes": None, "NodeNames": names}, indent=1).encode()  # spaces, newlines


def test_rotations_and_windows_are_the_held_strings() -> None:
    memo = NameMemo()
    first = decode_args(body(NODES), memo).NodeNames
    assert first == NODES
    for start in (0, 1, 17, 39):
        for length in (1, 2, 23, 40):
            want = (NODES + NODES)[start:start + length]
            got = decode_args(body(want), memo).NodeNames
            assert got == want
            assert got is not None and all(a is b for a, b in zip(got, first[start:] + first[:start], strict=False))


def test_prioritize_gets_the_answered_list_itself() -> None:
    memo = NameMemo()
    passed = ["node-003", "node-007"]
    raw = memo.answered(passed)
    assert decode_args(b'{"Pod": {}, "NodeNames": ' + raw + b"}", memo).NodeNames is passed


@given(st.lists(st.text(alphabet='ab",\\\u00e9 ', max_size=4), min_size=1, max_size=8, unique=True),
       st.lists(st.text(alphabet='ab",\\\u00e9 ', max_size=4), max_size=8), st.integers(0, 16), st.integers(0, 16),
       st.booleans())
@settings(max_examples=300, deadline=None)
def test_any_list_decodes_as_a_full_decode_would(held: list[str], other: list[str], start: int, length: int,
                                                 spaced: bool) -> None:
    memo = NameMemo()
    assert decode_args(body(held), memo).NodeNames == held
    window = (held + held)[start % len(held):][:length]
    for names in (window, other, window + other, other + window):
        spelling = "json" if spaced else "msgspec"
        assert decode_args(body(names, spelling), memo).NodeNames == names


def test_names_no_kubernetes_object_can_have_are_refused_held_or_not() -> None:
    memo = NameMemo()
    decode_args(body(NODES), memo)
    with pytest.raises(WireError, match=f"longer than {MAX_NAME}"):
        decode_args(body([*NODES[:3], "n" * (MAX_NAME + 1)]), memo)
    for bad in (b'{"Pod": {}, "NodeNames": ["\xff"]}', b'{"Pod": {}, "NodeNames": [1]}',
                b'{"Pod": {}, "NodeNames": {"a": 1}}'):
        with pytest.raises(WireError):
            decode_args(bad, memo)


def test_lists_longer_than_any_cluster_are_decoded_but_not_held(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NameMemo, "MAX_HELD", 10)
    memo = NameMemo()
    first = decode_args(body(NODES), memo).NodeNames
    again = decode_args(body(NODES), memo).NodeNames
    assert first == again == NODES and again is not None and first is not None and again[0] is not first[0]


@settings(max_examples=300, deadline=None)
@given(names=st.lists(st.text(min_size=1, max_size=12), max_size=30),
       scores=st.lists(st.integers(min_value=-2, max_value=300), max_size=30))
def test_prioritize_answer_decodes_as_the_struct_encoding(names: list[str], scores: list[int]) -> None:
    """The two-byte score slots decode (Go or Python alike: plain JSON) to exactly the HostPriority list,
    whatever the names (commas, quotes, escapes) and scores (0..10, or out of range: encoded in full)."""
    scores = [s if i % 3 else s % 11 for i, s in enumerate(scores)]  # mostly in range
    names = names[:len(scores)]
    scores = scores[:len(names)]
    expected = msgspec.json.encode(list(map(HostPriority, names, scores)))
    for raw in (None, msgspec.json.encode(names)):
        got = encode_priorities(names, scores, raw)
        assert json.loads(got) == json.loads(expected)
        assert msgspec.json.decode(got) == msgspec.json.decode(expected)


def test_prioritize_answer_reuses_the_filter_answer_bytes() -> None:
    memo = NameMemo()
    passed = ["a", "b,c", "d"]
    raw = memo.answered(passed)
    assert memo.encoded(passed) is raw and memo.encoded(list(passed)) is None
    got = encode_priorities(passed, [10, 3, 0], raw)
    assert json.loads(got) == [{"Host": "a", "Score": 10}, {"Host": "b,c", "Score": 3}, {"Host": "d", "Score": 0}]
    assert encode_priorities(["x", "y"], [7, 10]) == b'[{"Host":"x","Score":7 },{"Host":"y","Score":10}]'


def _outcome(raw: bytes, memo: NameMemo | None) -> object:
    try:
        args = decode_args(raw, memo)
    except WireError as e:
        return ("refused", str(e))
    names = None if args.NodeNames is None else list(args.NodeNames)
    return (args.Pod, None if args.Nodes is None else msgspec.to_builtins(args.Nodes), names)


_TRICKY_BODIES = [
    b'{"Pod":{"a":1},"Nodes":null,"NodeNames":["node-000"]}',
    b'{"Pod":{"a":",\\"NodeNames\\":[\\"x\\"]"},"NodeNames":["node-001"]}',  # the key's bytes inside a string
    b'{"Pod":{"x":{"y":1,"NodeNames":["node-002"]}}',  # nested key, body unbalanced
    b'{"Pod":{"x":{"y":1,"NodeNames":["node-002"]}}}',  # nested key, the top level has none
    b'{"Pod":{},"NodeNames":null,"NodeNames":["node-003"]}',  # a repeated key
    b'{"Pod":{},"NodeNames":["node-004"],"NodeNames":["node-005"]}',
    b'{"NodeNames":["node-006"],"Pod":{}}',  # another order
    b'{"Pod":{},"Nodes":{"items":[]},"NodeNames":["node-007"]}',
    b'{"Pod":null,"NodeNames":["node-008"]}',
    b'{"Nodes":null,"NodeNames":["node-009"]}',  # no Pod
    b'{"Pod":{},"NodeNames":["node-010",]}',  # not JSON
    b'{"Pod":{},"NodeNames":["node-011"] }',
    b'{"Pod":{},"NodeNames":[1]}',
    b'{"Pod":{},"NodeNames":["' + b"x" * (MAX_NAME + 1) + b'"]}',
    b'{"Pod":{"s":"a\\\\"},"NodeNames":["node-012"]}',  # an escaped backslash before the closing quote
    b'{"Pod":{"s":"\xff"},"NodeNames":["node-013"]}',  # not UTF-8 before the names
    b'{"Pod":{},"NodeNames":["\xff"]}',
    b'{"Pod":{},"NodeNames":[]}',
    b',"NodeNames":[]}',
]


@pytest.mark.parametrize("raw", _TRICKY_BODIES)
def test_names_read_apart_from_the_body_decode_as_the_whole_body_does(raw: bytes) -> None:
    """decode_args reads a body ending in its NodeNames array in two parts: whatever the body, the outcome
    (the arguments, or the refusal and its words) is what decoding the whole body gives."""
    memo = NameMemo()
    decode_args(body(NODES), memo)  # a held list, so that windows are matched too
    assert _outcome(raw, memo) == _outcome(raw, None)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(NODES), max_size=8), st.dictionaries(st.text(max_size=5), st.text(max_size=20),
                                                                      max_size=3),
       st.sampled_from(["msgspec", "json"]))
def test_any_body_decodes_as_the_whole_body_would(names: list[str], extra: dict[str, str], spelling: str) -> None:
    pod: dict[str, object] = {"metadata": {"name": "p", "annotations": extra}, "NodeNames": names}
    doc = {"Pod": pod, "Nodes": None, "NodeNames": names}
    raw = msgspec.json.encode(doc) if spelling == "msgspec" else json.dumps(doc).encode()
    memo = NameMemo()
    decode_args(body(NODES), memo)
    assert _outcome(raw, memo) == _outcome(raw, None)
