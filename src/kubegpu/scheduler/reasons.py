"""Why a node cannot take a demand, in words a person reads in kube-scheduler's FailedScheduling event.

kube-scheduler puts each reason into an Event message through a printf-style format, and prefixes it with
the number of nodes that gave it ("0/3 nodes are available: 2 <reason>."). So a reason never holds ``%``
(``50 % compute`` became ``50 %!c(MISSING)ompute``) and starts with words, not a number ("1 1 whole
GPU(s)"). :func:`readable` enforces both on every reason the extender sends, whoever wrote it.

A filter answers thousands of nodes, most failing, with few distinct reasons: reasons are kept per row as
codes into a :class:`TextTable` (:class:`ReasonCache`, by row version), and the answer's map is built from
byte tables (:class:`NameTable`, :class:`ReasonMap`) rather than a dict of thousands of entries encoded anew
per pod.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping, Sequence

import msgspec
import numpy as np

from kubegpu.placement import ClusterState, Demand
from kubegpu.placement.policies import RowCache

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(str).decode


def insufficient(cluster: ClusterState, rows: np.ndarray, demand: Demand,
                 candidates: np.ndarray | None = None) -> list[str]:
    """Readable reasons for nodes that cannot take ``demand``, from the arrays. Nodes in the same
    situation get the same text (kube-scheduler's event then counts them together), so each distinct
    situation is worded once: rows are reduced to an integer code, and only unique codes are formatted.
    A text says how much the node has against what was requested, never which GPU: an index would split
    one situation into up to eight texts in the event (whose message kube-scheduler cuts at 1 KiB) and
    lengthen every filter answer, most of whose bytes these texts are.
    A row's text depends on that row's arrays and the demand alone. ``candidates``: the cluster's
    ``gpu_candidates(demand)`` when the caller has it. A filter mostly words the few rows changed since the
    last filter of its demand, so the steps are few numpy calls, whatever the number of rows."""
    n = len(rows)
    idx = np.arange(n)
    ok = cluster.gpu_ok[rows]
    core = np.where(ok, cluster.core_free[rows], -1).astype(np.int64)
    cand = cluster.gpu_candidates(demand, rows) if candidates is None else candidates[rows]
    n_cand = cand.sum(axis=1, dtype=np.int64)
    n_ok = ok.sum(axis=1, dtype=np.int64)
    best = core.argmax(axis=1)
    best_pct = np.maximum(core[idx, best], 0) // 10
    none_ok = n_ok == 0
    mem_free = mem_need = None
    if demand.exclusive:  # 0 no usable GPU, 1 whole GPUs short
        case = np.where(none_ok, 0, 1)
        param = (n_cand << 16) | n_ok
    elif demand.count > 1:  # 2 too few GPUs with room, 3 compute short
        case = np.where(none_ok, 0, np.where(n_cand > 0, 2, 3))
        param = np.where(n_cand > 0, n_cand, best_pct)
    else:  # 3 compute short, 4 memory short (there is compute, but no GPU with it has the memory)
        roomy = core >= demand.milli
        any_roomy = roomy.any(axis=1)
        case = np.where(none_ok, 0, np.where(any_roomy, 4, 3))
        mem = np.where(roomy, cluster.gmem_free[rows], -1)
        mem_best = mem.argmax(axis=1)
        tenth_gib = 2**30 // 10
        mem_free = np.maximum(mem[idx, mem_best], 0) // tenth_gib
        mem_need = cluster.gpu_memory_need(demand, rows)[idx, mem_best] // tenth_gib
        # each in its own bits (a need of 1.6 PiB or more shares a code, and so its first row's text)
        param = np.where(any_roomy, (np.minimum(mem_free, 2**31 - 1) << 24) | np.minimum(mem_need, 2**24 - 1),
                         best_pct)
    codes = ((case.astype(np.int64) << 56) | np.where(none_ok, 0, param)).tolist()
    # The distinct codes in first-seen order, and each row's index among them (a dict: few rows, few codes).
    index: dict[int, int] = {}
    inverse = [index.setdefault(c, len(index)) for c in codes]
    first = [0] * len(index)
    for k in range(n - 1, -1, -1):
        first[inverse[k]] = k
    want = demand.milli // 10
    texts = []
    for k in first:
        c = int(case[k])
        if c == 0:
            texts.append("no healthy GPU to share (all unhealthy or MIG-enabled)")
        elif c == 1:
            texts.append(f"free whole GPUs: {n_cand[k]} of {n_ok[k]}, {demand.count} requested")
        elif c == 2:
            texts.append(f"GPUs with {want} percent compute free: {n_cand[k]}, {demand.count} requested")
        elif c == 3:
            texts.append(f"GPU compute free: {best_pct[k]} percent at most, {want} percent requested")
        else:
            assert mem_free is not None and mem_need is not None
            texts.append(f"GPU memory free with the compute: {mem_free[k] / 10:.1f} GiB at most, "
                         f"{mem_need[k] / 10:.1f} GiB requested")
    return [texts[i] for i in inverse]


class TextTable:
    """Distinct texts, each with a code and its readable JSON string: per-row reasons are kept as codes
    (an integer per row, no object per node), and an answer's texts are encoded once each."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.json: list[bytes] = []  # readable(text) as a JSON string
        self._code: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.texts)

    def code(self, text: str) -> int:
        c = self._code.get(text)
        if c is None:
            c = self._code[text] = len(self.texts)
            self.texts.append(text)
            self.json.append(_encode(readable(text)))
        return c

    def codes(self, texts: Sequence[str]) -> np.ndarray:
        return np.fromiter(map(self.code, texts), np.int64, len(texts))


class ReasonCache:
    """Per-row :func:`insufficient` reasons per demand, kept as codes into one :class:`TextTable` with the row
    version they were worded at (a :class:`~kubegpu.placement.policies.RowCache`): a filter pays only for
    the rows changed since the last filter with the same demand, not for thousands of nodes. At most
    ``limit`` demands are kept, least recently used dropped; the table is emptied with them when it holds
    ``max_texts`` texts (situations are many only where GPUs are)."""

    def __init__(self, limit: int = 64, max_texts: int = 100_000) -> None:
        self._rows = RowCache(limit, dtype=np.int64)
        self.table = TextTable()
        self.max_texts = max_texts

    def clear(self) -> None:
        self._rows.clear()
        self.table = TextTable()

    def codes(self, cluster: ClusterState, rows: np.ndarray, demand: Demand,
              candidates: np.ndarray | None = None) -> tuple[TextTable, np.ndarray]:
        """The table and each row's code of its :func:`insufficient` text, worded only where a row changed."""
        if len(self.table) >= self.max_texts:
            self.clear()
        table = self.table

        def word(pos: np.ndarray) -> np.ndarray:
            return table.codes(insufficient(cluster, rows[pos], demand, candidates))

        return table, self._rows.get(demand, cluster, rows, word)

    def insufficient(self, cluster: ClusterState, rows: np.ndarray, demand: Demand,
                     candidates: np.ndarray | None = None) -> list[str]:
        """:func:`insufficient` of ``rows`` (same texts), from the kept codes."""
        table, codes = self.codes(cluster, rows, demand, candidates)
        return [table.texts[c] for c in codes.tolist()]


class NameTable:
    """Node names as JSON strings, one row each of a byte matrix, padded with spaces to one width (JSON allows
    spaces between tokens): answers take rows of it instead of touching a string object per node. Kept per
    array layout by the extender."""

    def __init__(self, names: Sequence[str]) -> None:
        tokens = list(map(_encode, names))
        self.width = max(map(len, tokens), default=2) + 1  # and a separator after each name
        self.matrix = np.frombuffer(b"".join(t.ljust(self.width - 1) + b"," for t in tokens), np.uint8).reshape(
            len(tokens), self.width)
        self.uniform = all(len(t) == self.width - 1 for t in tokens)
        self.spaceless = not any(b" " in t for t in tokens)  # padding is then the only space: removable

    def list_json(self, rows: np.ndarray) -> bytes | None:
        """The canonical JSON array of the rows' names (msgspec's encoding of the list), or None when padding
        cannot be told from the names."""
        if not len(rows):
            return b"[]"
        if not (self.uniform or self.spaceless):
            return None
        flat = np.take(self.matrix, rows, axis=0).reshape(-1)
        if not self.uniform:
            flat = flat[flat != ord(" ")]
        flat[-1] = ord("]")
        return b"[" + flat.tobytes()

    def keys(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), width) bytes: each row's name as a JSON object key, ``"name"   :``."""
        out = np.take(self.matrix, rows, axis=0)
        out[:, -1] = ord(":")
        return out


class ReasonMap(Mapping[str, str]):
    """Failed nodes and their reasons, held as what the filter answer's JSON map is built from: the rows of
    failed nodes with the :class:`NameTable` of their names and a code per row into a :class:`TextTable`.
    :meth:`json` is byte matrices and one copy (no object per node); the mapping of names to texts (what the
    tests and the exact paths read) is built only when read. Entries set one by one (``map[name] = text``)
    are kept aside and come after the rows' in both. Names are distinct (a filter fails each node once);
    were one repeated, its last entry would win in both, as JSON decoders keep a repeated key's last value."""

    __slots__ = ("_dict", "_loose", "_parts")

    def __init__(self) -> None:
        self._parts: list[tuple[np.ndarray, np.ndarray, NameTable, TextTable, np.ndarray]] = []
        self._loose: dict[str, str] = {}
        self._dict: dict[str, str] | None = None

    def add_rows(self, by_row: np.ndarray, rows: np.ndarray, names: NameTable, table: TextTable,
                 codes: np.ndarray) -> None:
        """Rows ``rows`` (names ``by_row[rows]``, JSON in ``names``) failed with ``table``'s texts ``codes``."""
        if len(rows) != len(codes):
            raise ValueError("rows and codes differ in length")
        if len(rows):
            self._parts.append((by_row, rows, names, table, codes))
            self._dict = None

    def add_texts(self, by_row: np.ndarray, rows: np.ndarray, names: NameTable, texts: Sequence[str]) -> None:
        table = TextTable()
        self.add_rows(by_row, rows, names, table, table.codes(texts))

    def __setitem__(self, name: str, text: str) -> None:
        self._loose[name] = text
        self._dict = None

    def json(self) -> bytes:
        """The JSON object ``{"name": "reason", ...}`` (reasons readable, as :class:`TextTable` keeps them).

        Written into one buffer the size of the answer: joining blocks of a few hundred KiB, then trimming
        the last comma, cost a fresh large allocation (page faults) per step, ~8x the rest of the work."""
        blocks = []
        total = 1  # the opening brace; the last comma becomes the closing one
        for _, rows, names, table, codes in self._parts:
            # The texts this answer uses, each once, padded to the longest of them (codes index the table).
            used = np.zeros(len(table), bool)
            used[codes] = True
            distinct = np.flatnonzero(used)
            local = np.empty(len(table), np.int64)
            local[distinct] = np.arange(len(distinct))
            texts = [table.json[c] for c in distinct.tolist()]
            width = max(map(len, texts)) + 1
            values = np.frombuffer(b"".join(t.ljust(width - 1) + b"," for t in texts), np.uint8).reshape(
                len(texts), width)
            blocks.append((rows, names, values, local[codes]))
            total += len(rows) * (names.width + width)
        loose = (b"".join(_encode(k) + b":" + _encode(readable(v)) + b"," for k, v in self._loose.items())
                 if self._loose else b"")
        total += len(loose)
        if total == 1:
            return b"{}"
        out = np.empty(total, np.uint8)
        out[0] = ord("{")
        at = 1
        for rows, names, values, which in blocks:
            n, w = len(rows), names.width + values.shape[1]
            np.concatenate([names.keys(rows), np.take(values, which, axis=0)], axis=1,
                           out=out[at:at + n * w].reshape(n, w))
            at += n * w
        out[at:] = np.frombuffer(loose, np.uint8)
        out[-1] = ord("}")
        return out.tobytes()

    def _map(self) -> dict[str, str]:
        if self._dict is None:
            out: dict[str, str] = {}
            for by_row, rows, _, table, codes in self._parts:
                out.update(zip(by_row[rows].tolist(), (_decode(table.json[c]) for c in codes.tolist()), strict=True))
            out.update(self._loose)
            self._dict = out
        return self._dict

    def __getitem__(self, name: str) -> str:
        return self._map()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._map())

    def __len__(self) -> int:
        return len(self._map())

    def __repr__(self) -> str:
        return f"ReasonMap({self._map()!r})"


_PERCENT = re.compile(r"\s*%")
_PLURAL = re.compile(r"\b(GPU|device|container)\(s\)")


@functools.lru_cache(maxsize=4096)  # nodes in the same situation share a text: a filter rewords few
def readable(reason: str) -> str:
    """A reason as kube-scheduler's Event shows it well: no ``%`` (it is a format string there), no ``(s)``
    plurals, and a leading word (the Event puts a node count in front)."""
    if "%" not in reason and "(s)" not in reason and not reason[:1].isdigit():
        return reason  # already readable (most are): no regex, whatever the cache holds
    text = _PERCENT.sub(" percent", reason)
    text = _PLURAL.sub(r"\1s", text)
    if text[:1].isdigit():
        text = "not enough GPUs: " + text
    return text
