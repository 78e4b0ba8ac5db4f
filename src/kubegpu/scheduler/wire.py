"""The scheduler-extender v1 wire format (``k8s.io/kube-scheduler/extender/v1``), decoded and encoded with msgspec.

The Go types carry no JSON tags, so the keys are the capitalised field names.
Nested Kubernetes objects (the Pod, the Nodes) stay plain dicts in their own
lowerCamel JSON. Decoding never raises anything but :class:`WireError`, whose
message is what the HTTP 400 answer says.

With ``nodeCacheCapable`` kube-scheduler sends node names only, thousands per
``/filter``, each time a window of the same node order starting at a rotating
index, and sends ``/prioritize`` the very list ``/filter`` answered. Those lists
are recognised by their bytes (:class:`NameMemo`) and answered with the name
strings already held, so a repeat costs a few byte comparisons instead of
thousands of new strings (and their hashes, and a lookup each). A window of the
held list says where it lies in it (:class:`NameWindow`), so the extender maps
it to array rows with a slice of rows mapped once, not a lookup per name. A body
that ends with its name list, as kube-scheduler's do, is decoded without it and
the list read by the memo alone (:func:`_names_last`), so the list's bytes are
not scanned twice.

Answers are built from byte tables kept per node row (the names' JSON, padded to
one width: :class:`HostTable`, :class:`~kubegpu.scheduler.reasons.NameTable`)
and per distinct reason, taken and copied once, not from thousands of objects
encoded anew per pod; the lists are held as where their names are
(:class:`NameWindow`, :class:`RowNames`), never copied name by name.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Annotated, Any, TypeVar, overload

import msgspec
import numpy as np

from kubegpu.scheduler.reasons import ReasonMap, readable

MAX_NAME = 253  # a DNS subdomain, the longest name Kubernetes gives a pod, a namespace or a node
MAX_SCORE = 10  # kube-scheduler's MaxExtenderPriority


class WireError(ValueError):
    """A request body that is not a valid extender message."""


class NodeList(msgspec.Struct, omit_defaults=False):
    items: list[dict[str, Any]] = []
    metadata: dict[str, Any] = {}


class _ExtenderArgs(msgspec.Struct):
    Pod: dict[str, Any] | None = None
    Nodes: NodeList | None = None
    NodeNames: msgspec.Raw = msgspec.Raw()  # the JSON array as sent, read through a NameMemo


@dataclass(frozen=True, slots=True)
class ExtenderArgs:
    """A decoded filter or prioritize body. ``NodeNames`` is None when kube-scheduler sent full
    ``Nodes`` (not ``nodeCacheCapable``); the list may be shared with a :class:`NameMemo`: never
    change it."""

    Pod: dict[str, Any] | None
    Nodes: NodeList | None
    NodeNames: Sequence[str] | None


class ExtenderBindingArgs(msgspec.Struct):
    PodName: str = ""
    PodNamespace: str = ""
    PodUID: str = ""
    Node: str = ""


class ExtenderFilterResult(msgspec.Struct):
    Nodes: NodeList | None
    NodeNames: list[str] | msgspec.Raw | None  # Raw: the names already encoded (NameMemo.answered)
    # A ReasonMap is sent as the JSON it holds (its texts are readable as its tokens were made)
    FailedNodes: Mapping[str, str] | msgspec.Raw
    FailedAndUnresolvableNodes: Mapping[str, str] | msgspec.Raw
    Error: str = ""

    def __post_init__(self) -> None:
        # kube-scheduler formats these into Events: worded for that (scheduler/reasons.py). Thousands of
        # nodes per filter, few distinct reasons (mostly the same string objects): reword the distinct
        # ones, and rebuild a map only when one of them changes.
        self.FailedNodes = _readable_map(self.FailedNodes)
        self.FailedAndUnresolvableNodes = _readable_map(self.FailedAndUnresolvableNodes)
        self.Error = readable(self.Error) if self.Error else ""


def _readable_map(reasons: Mapping[str, str] | msgspec.Raw) -> dict[str, str] | msgspec.Raw:
    if isinstance(reasons, ReasonMap):
        return msgspec.Raw(reasons.json())
    if isinstance(reasons, msgspec.Raw):
        return reasons
    return _readable_values(reasons if isinstance(reasons, dict) else dict(reasons))


def _readable_values(reasons: dict[str, str]) -> dict[str, str]:
    distinct = set(reasons.values())
    # Equal, not the same object: readable's cache answers an equal text worded earlier with that earlier
    # string, and the row caches word a changed row anew, so identity would rebuild nearly every answer.
    if all(readable(r) == r for r in distinct):
        return reasons
    return dict(zip(reasons, map(readable, reasons.values()), strict=True))


class HostPriority(msgspec.Struct, gc=False):  # thousands per answer, no references: never tracked
    Host: str
    Score: int


_HOST_SEP = b',"Score":  },{"Host":'  # between two names' JSON: a score slot of two bytes, then the next host
_COMMA, _SPACE, _ZERO = ord(","), ord(" "), ord("0")


def encode_priorities(names: Sequence[str], scores: list[int], raw: bytes | None = None) -> bytes:
    """The JSON of ``list(map(HostPriority, names, scores))`` as Go's decoder reads it, built without a
    struct per host: prioritize answers thousands. ``raw``: ``encode(names)`` when the caller has it.

    Each score takes a two-byte slot (``5`` is written ``5 ``: JSON allows the space, and a score is
    0..10), so the answer is the names' canonical JSON with one C-level ``replace`` of its separators and
    the digits set through numpy. Correct by construction: the separators are replaced only when the
    array holds exactly ``len(names) - 1`` commas, i.e. no name holds one; otherwise (or for a score
    outside 0..10) the answer is encoded struct by struct."""
    n = len(names)
    if n == 0 or n != len(scores):
        return encode(list(map(HostPriority, names, scores)))
    if raw is None:
        raw = encode(list(names))
    inner = raw[1:-1]
    try:
        digits = np.frombuffer(bytes(scores), np.uint8)  # bytes(): ints in 0..255 or an error, in C
    except (TypeError, ValueError):
        digits = None
    if digits is None or digits.max() > 10 or inner.count(b",") != n - 1:
        return encode(list(map(HostPriority, names, scores)))
    out = bytearray().join([b'[{"Host":', inner.replace(b",", _HOST_SEP), b',"Score":  }]'])
    buf = np.frombuffer(out, np.uint8)
    # each slot follows its name's JSON, shifted by the bytes inserted before it
    ends = np.empty(n, np.int64)
    ends[:-1] = np.flatnonzero(np.frombuffer(inner, np.uint8) == _COMMA)
    ends[-1] = len(inner)
    slots = ends + (len(b'[{"Host":') + len(b',"Score":')) + np.arange(n, dtype=np.int64) * (len(_HOST_SEP) - 1)
    ten = digits == 10
    buf[slots] = np.where(ten, _ZERO + 1, _ZERO + digits)
    buf[slots + 1] = np.where(ten, _ZERO, _SPACE)
    return bytes(out)


class HostTable:
    """Every node row's entry of a prioritize answer, ``{"Host":"name","Score":NN},``, as one row of a byte
    matrix of equal widths (spaces after the name, which JSON allows between tokens, make them equal): an
    answer is a take of rows, two score bytes set per row, and one copy, with no object per node.

    ``None`` from :meth:`build` where the names' lengths differ too much for padding to be cheap (then the
    answer is built by :func:`encode_priorities`)."""

    MAX_PAD = 24  # bytes of spaces a row may carry (names of one cluster mostly have similar lengths)
    _HEAD = b'{"Host":'
    _TAIL = b',"Score":  },'

    def __init__(self, matrix: np.ndarray) -> None:
        self.matrix = matrix  # (N, W) uint8
        self.width = matrix.shape[1]

    @classmethod
    def build(cls, names: list[str]) -> HostTable | None:
        tokens = list(map(encode, names))
        if not tokens:
            return None
        widest, narrowest = max(map(len, tokens)), min(map(len, tokens))
        if widest - narrowest > cls.MAX_PAD:
            return None
        width = len(cls._HEAD) + widest + len(cls._TAIL)
        flat = b"".join(cls._HEAD + t.ljust(widest) + cls._TAIL for t in tokens)
        matrix = np.frombuffer(flat, np.uint8).reshape(len(tokens), width)
        matrix.flags.writeable = False
        return cls(matrix)

    def answer(self, rows: np.ndarray, scores: np.ndarray) -> bytes | None:
        """The JSON of the rows' ``HostPriority`` entries with ``scores`` (0..10); None for a score outside."""
        n = len(rows)
        if n == 0:
            return b"[]"
        scores = np.asarray(scores)
        if scores.dtype.kind not in "iu" or scores.min() < 0 or scores.max() > MAX_SCORE or len(scores) != n:
            return None
        flat = np.empty(n * self.width + 1, np.uint8)
        flat[0] = ord("[")
        body = flat[1:].reshape(n, self.width)
        np.take(self.matrix, rows, axis=0, out=body)
        ten = scores >= MAX_SCORE
        slot = self.width - 4  # the two score bytes, before "},"
        body[:, slot] = np.where(ten, ord("1"), ord("0") + scores)
        body[:, slot + 1] = np.where(ten, ord("0"), ord(" "))
        flat[-1] = ord("]")  # in place of the last entry's comma
        return flat.tobytes()


class ExtenderBindingResult(msgspec.Struct):
    Error: str = ""


T = TypeVar("T")
_args = msgspec.json.Decoder(_ExtenderArgs)
_names = msgspec.json.Decoder(list[Annotated[str, msgspec.Meta(max_length=MAX_NAME)]])  # checked in C
_bind = msgspec.json.Decoder(ExtenderBindingArgs)
encode = msgspec.json.Encoder().encode


class HeldNames:
    """One list a :class:`NameMemo` holds: its names twice over (every rotation is a slice of them)."""

    __slots__ = ("names",)

    def __init__(self, names: list[str]) -> None:
        self.names = names + names

    def __len__(self) -> int:
        return len(self.names) // 2


class _Names(Sequence[str]):
    """A node list held as where its names are, listed only when read as a list: thousands of names per
    request, and copying a list of them touches every string object (its reference count), which costs more
    than the answer itself once they are out of the processor's caches. Never change it."""

    __slots__ = ("_list",)

    def __init__(self) -> None:
        self._list: list[str] | None = None

    def _take(self) -> list[str]:
        raise NotImplementedError

    def listed(self) -> list[str]:
        if self._list is None:
            self._list = self._take()
        return self._list

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        return self.listed()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self.listed())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Names | list | tuple):
            return self.listed() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.listed()!r})"


class NameWindow(_Names):
    """The names ``held.names[start:stop]`` (a window, cyclically, of the list a :class:`NameMemo` holds): a
    caller that keeps something per held name takes a slice of it instead of looking every name up."""

    __slots__ = ("held", "start", "stop")

    def __init__(self, held: HeldNames, start: int, stop: int) -> None:
        super().__init__()
        self.held, self.start, self.stop = held, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int | slice) -> str | list[str]:  # type: ignore[override]
        if isinstance(i, slice):
            return self.listed()[i]
        n = self.stop - self.start
        if not -n <= i < n:
            raise IndexError("name index out of range")
        return self.held.names[self.start + (i if i >= 0 else i + n)]

    def __iter__(self) -> Iterator[str]:
        return islice(self.held.names, self.start, self.stop)

    def _take(self) -> list[str]:
        return self.held.names[self.start:self.stop]


class RowNames(_Names):
    """The names of some node rows, ``by_row[rows]``: a filter's passing nodes, which the extender answers as
    JSON from its :class:`~kubegpu.scheduler.reasons.NameTable` and recognises by this object when
    prioritize is sent the same list."""

    __slots__ = ("by_row", "rows")

    def __init__(self, by_row: np.ndarray, rows: np.ndarray) -> None:
        super().__init__()
        self.by_row, self.rows = by_row, rows

    def __len__(self) -> int:
        return len(self.rows)

    def _take(self) -> list[str]:
        out: list[str] = self.by_row[self.rows].tolist()
        return out


class NameMemo:
    """The longest node-name list seen lately, by its canonical JSON bytes, and the last list a filter
    answered: a list that is byte for byte a window of the first (cyclically: kube-scheduler starts each
    cycle at a rotating node) or the second is answered with the strings held.

    Correct by construction: a window is accepted only when it starts and ends on the boundaries of held
    names and its bytes equal theirs, and the held bytes are the canonical encoding of the held names
    (msgspec's, which decoding inverts), so the bytes decode to exactly those names. Anything else is
    decoded in full (and, when it is at least as long, or the held list keeps missing, held next)."""

    MISSES_BEFORE_REPLACING = 8
    MAX_HELD = 20_000  # names: 4x Kubernetes' largest supported cluster; a longer (hostile) list is not held

    def __init__(self) -> None:
        self._ring = b""  # the held list's inner bytes, twice, joined by a comma: every rotation is a slice
        self._held = HeldNames([])  # the held names, twice
        self._starts: list[int] = []  # byte offset of each name of the ring (and the ring's length + 1)
        self._at: dict[bytes, int] = {}  # each held name's JSON -> its index
        self._misses = 0
        self._answer: tuple[bytes, Sequence[str]] = (b"[]", [])

    def names(self, raw: bytes) -> Sequence[str]:
        """The names in ``raw`` (a JSON array of strings, any spelling). Raises :class:`WireError`."""
        if raw == self._answer[0]:
            return self._answer[1]
        held = self._window(raw)
        if held is not None:
            self._misses = 0
            return held
        try:
            names = _names.decode(raw)
        except msgspec.ValidationError as e:
            if "length" in str(e):
                raise WireError(f"a node name longer than {MAX_NAME} characters") from None
            raise WireError(f"not an ExtenderArgs JSON object: NodeNames: {str(e)[:200]}") from None
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
            raise WireError("not an ExtenderArgs JSON object: NodeNames is not an array of strings "
                            "(valid UTF-8)") from None
        self._misses += 1
        if 0 < len(names) <= self.MAX_HELD and (len(names) >= len(self._held)
                                                 or self._misses >= self.MISSES_BEFORE_REPLACING):
            self._hold(names, raw)
        return names

    def encoded(self, names: Sequence[str]) -> bytes | None:
        """The canonical JSON of ``names`` when it is the very list the last filter answered."""
        return self._answer[0] if names is self._answer[1] else None

    def answered(self, names: Sequence[str], raw: bytes | None = None) -> bytes:
        """The JSON of a filter's passing names, remembered: prioritize is sent exactly this list. ``raw``:
        their canonical JSON (``encode(list(names))``) when the caller has it."""
        if raw is None:
            raw = encode(list(names))
        self._answer = (raw, names)
        return raw

    def _window(self, raw: bytes) -> NameWindow | None:
        if not self._at or len(raw) < 2 or raw[0] != 0x5B or raw[-1] != 0x5D:  # [ ... ]
            return None
        size = len(raw) - 2  # the array's inner bytes, compared in place (no copy of tens of KiB)
        if size * 2 + 1 > len(self._ring):  # longer than the held list
            return None
        cut = raw.find(b'",', 1)
        p = self._at.get(raw[1:-1] if cut < 0 else raw[1:cut + 1])
        if p is None:
            return None
        start = self._starts[p]
        end = start + size
        q = bisect_left(self._starts, end + 1)  # the window must end where a held name ends
        if q >= len(self._starts) or self._starts[q] != end + 1 or q - p > len(self._at):
            return None
        if not self._ring.startswith(memoryview(raw)[1:-1], start):
            return None
        return NameWindow(self._held, p, q)

    def _hold(self, names: list[str], raw: bytes) -> None:
        tokens = list(map(encode, names))
        if b"[" + b",".join(tokens) + b"]" != raw or len(set(tokens)) != len(tokens):
            self._at = {}  # not the canonical spelling (or repeats a name): nothing to match windows against
            return
        self._ring = b",".join(tokens + tokens)
        self._held = HeldNames(names)
        starts = [0]
        for t in tokens + tokens:
            starts.append(starts[-1] + len(t) + 1)
        self._starts = starts
        self._at = {t: i for i, t in enumerate(tokens)}
        self._misses = 0


_NAMES_KEY = b',"NodeNames":['


def _names_last(body: bytes, memo: NameMemo) -> ExtenderArgs | None:
    """The arguments of a body that ends with its NodeNames array, as kube-scheduler encodes them
    (``{"Pod":...,"Nodes":null,"NodeNames":[...]}``), without msgspec scanning the array's tens of KiB only
    to skip them: the rest is decoded with a closing brace in the array's place, the array by ``memo``.
    Sound because ``,"`` never occurs inside a JSON string (a quote there is escaped), and the rest with
    one ``}`` added is a complete object only if the found key is one of the body's own top-level keys;
    the array is then exactly the body's value for it. None (decode the whole body) for anything else:
    another spelling, a NodeNames key also among the rest, a body that is not valid, so that every
    refusal says what decoding the whole body says."""
    if not body.endswith(b"]}"):
        return None
    at = body.rfind(_NAMES_KEY)
    if at < 0:
        return None
    try:
        args = _args.decode(body[:at] + b"}")
        if args.Pod is None or args.Nodes is not None or bytes(args.NodeNames) != b"":
            return None
        names = memo.names(body[at + len(_NAMES_KEY) - 1:-1])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError, WireError):
        return None
    return ExtenderArgs(args.Pod, None, names)


def _decode(decoder: msgspec.json.Decoder[T], body: bytes, what: str) -> T:
    """``body`` decoded, or :class:`WireError` saying why it is not a ``what`` JSON object."""
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"not an {what} JSON object: {str(e)[:200]}") from None
    except RecursionError:
        raise WireError(f"not an {what} JSON object: nested too deeply") from None
    except UnicodeDecodeError:  # msgspec decodes strings as UTF-8 and raises this, not DecodeError
        raise WireError(f"not an {what} JSON object: a string is not valid UTF-8") from None


def decode_args(body: bytes, memo: NameMemo | None = None) -> ExtenderArgs:
    if memo is not None and (fast := _names_last(body, memo)) is not None:
        return fast
    args = _decode(_args, body, "ExtenderArgs")
    raw = bytes(args.NodeNames)
    names = None if raw in (b"", b"null") else (memo or NameMemo()).names(raw)
    if args.Pod is None:
        raise WireError("ExtenderArgs without a Pod")
    if names is None and args.Nodes is None:
        raise WireError("ExtenderArgs with neither NodeNames nor Nodes")
    if args.Nodes is not None:
        for i, item in enumerate(args.Nodes.items):
            meta = item.get("metadata")
            if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
                raise WireError(f"Nodes.items[{i}] has no metadata.name")
            if len(meta["name"]) > MAX_NAME:
                raise WireError(f"a node name longer than {MAX_NAME} characters")
    return ExtenderArgs(args.Pod, args.Nodes, names)


def node_names(args: ExtenderArgs) -> Sequence[str]:
    if args.NodeNames is not None:
        return args.NodeNames
    assert args.Nodes is not None
    return [item["metadata"]["name"] for item in args.Nodes.items]


def decode_binding(body: bytes) -> ExtenderBindingArgs:
    args = _decode(_bind, body, "ExtenderBindingArgs")
    missing = [k for k in ("PodName", "PodNamespace", "Node") if not getattr(args, k)]
    if missing:
        raise WireError(f"ExtenderBindingArgs without {', '.join(missing)}")
    long = [k for k in ("PodName", "PodNamespace", "Node", "PodUID") if len(getattr(args, k)) > MAX_NAME]
    if long:  # no Kubernetes name is this long; never echo it into logs and errors
        raise WireError(f"ExtenderBindingArgs {', '.join(long)} longer than {MAX_NAME} characters")
    return args
