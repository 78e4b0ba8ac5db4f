"""Reading openb-format trace files (Alibaba's GPU-sharing cluster trace, ATC '23).

Node lists: ``sn,cpu_milli,memory_mib,gpu,model``. Pod lists: ``name,cpu_milli,
memory_mib,num_gpu,gpu_milli,gpu_spec[,qos,pod_phase,creation_time,
deletion_time,scheduled_time]``. A bad file or row is a :class:`TraceError`
naming the file, the line and the field, never a crash deep in the replay.
The default node and pod lists ship inside the package.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kubegpu.model.annotations import split_models
from kubegpu.placement.cluster import MILLI, ClusterState, Demand

MIB = 2**20
DEFAULT_NODES = "openb_node_list_gpu_node.csv"
DEFAULT_PODS = "openb_pod_list_default.csv"
# Sanity bounds: far above any real node, low enough to catch unit mistakes (bytes for MiB).
MAX_CPU_MILLI = 10_000_000
MAX_MEMORY_MIB = 1 << 30
MAX_GPUS = 64


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file, line and field."""


@dataclass(frozen=True, slots=True)
class TracePod:
    """One task of the trace as a placement demand, with its timestamps (seconds; -1 = unknown)."""

    name: str
    demand: Demand
    creation: int = -1
    deletion: int = -1

    @property
    def kind(self) -> str:
        """A coarse kind for failure counts: cpu, share, 1-gpu, 2-gpu, ..."""
        d = self.demand
        if d.count == 0:
            return "cpu"
        if not d.exclusive:
            return "share" if d.count == 1 else f"share-{d.count}"
        return f"{d.count}-gpu"


@dataclass(frozen=True, slots=True)
class TraceNodes:
    """A node list: names, models, GPU counts, CPU and memory."""

    names: tuple[str, ...]
    models: tuple[str, ...]
    gpus: tuple[int, ...]
    cpu_milli: tuple[int, ...]
    memory_bytes: tuple[int, ...]

    @property
    def total_gpus(self) -> int:
        return sum(self.gpus)

    def cluster(self) -> ClusterState:
        """An empty cluster of these nodes."""
        return ClusterState.from_arrays(self.names, self.models, self.gpus, self.cpu_milli, self.memory_bytes)

    def gpu_only(self) -> TraceNodes:
        """Only the nodes with GPUs (the paper's experiments)."""
        keep = [i for i, g in enumerate(self.gpus) if g > 0]
        return TraceNodes(
            *(
                tuple(getattr(self, f)[i] for i in keep)
                for f in ("names", "models", "gpus", "cpu_milli", "memory_bytes")
            )
        )


def default_path(name: str) -> Path:
    """Path of a packaged trace file."""
    return Path(str(resources.files("kubegpu.sim").joinpath("data", name)))


def _rows(path: Path, required: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            missing = [c for c in required if c not in header]
            if missing:
                raise TraceError(f"{path}: missing column(s) {', '.join(missing)} (header: {','.join(header)})")
            return [(i + 2, row) for i, row in enumerate(reader)]
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (csv.Error, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: not a CSV file: {exc}") from None


def _int(path: Path, line: int, row: dict[str, str], field: str, lo: int, hi: int, default: int | None = None) -> int:
    raw = (row.get(field) or "").strip()
    if raw == "" and default is not None:
        return default
    try:
        value = int(float(raw)) if raw and "." in raw else int(raw)
    except (ValueError, OverflowError):  # OverflowError: "1.0e999" is inf
        raise TraceError(f"{path}:{line}: {field}={raw!r} is not a number") from None
    if not lo <= value <= hi:
        raise TraceError(f"{path}:{line}: {field}={value} is out of range {lo}..{hi}")
    return value


def load_nodes(path: Path | str | None = None) -> TraceNodes:
    """Read a node list (the packaged GPU node list by default)."""
    p = Path(path) if path is not None else default_path(DEFAULT_NODES)
    rows = _rows(p, ("sn", "cpu_milli", "memory_mib", "gpu"))
    if not rows:
        raise TraceError(f"{p}: no nodes")
    names, models, gpus, cpus, mems = [], [], [], [], []
    for line, row in rows:
        names.append((row.get("sn") or f"node-{line}").strip())
        models.append((row.get("model") or "").strip())
        gpus.append(_int(p, line, row, "gpu", 0, MAX_GPUS))
        cpus.append(_int(p, line, row, "cpu_milli", 0, MAX_CPU_MILLI))
        mems.append(_int(p, line, row, "memory_mib", 0, MAX_MEMORY_MIB) * MIB)
    # Name order: ties between equally scored nodes go to the lowest name, as in the FGD simulator.
    order = sorted(range(len(names)), key=lambda i: names[i])
    return TraceNodes(tuple(names[i] for i in order), tuple(models[i] for i in order), tuple(gpus[i] for i in order),
                      tuple(cpus[i] for i in order), tuple(mems[i] for i in order))


def load_pods(path: Path | str | None = None) -> list[TracePod]:
    """Read a pod list (the packaged default by default)."""
    p = Path(path) if path is not None else default_path(DEFAULT_PODS)
    rows = _rows(p, ("cpu_milli", "memory_mib", "num_gpu", "gpu_milli"))
    if not rows:
        raise TraceError(f"{p}: no pods")
    pods = []
    for line, row in rows:
        cpu = _int(p, line, row, "cpu_milli", 0, MAX_CPU_MILLI)
        mem = _int(p, line, row, "memory_mib", 0, MAX_MEMORY_MIB) * MIB
        n = _int(p, line, row, "num_gpu", 0, MAX_GPUS)
        milli = _int(p, line, row, "gpu_milli", 0, MILLI)
        spec = (row.get("gpu_spec") or "").strip()
        models = split_models(spec) or None
        if n == 0 or milli == 0:
            demand = Demand(0, 0, 0, 0, False, cpu, mem, None)
        elif milli == MILLI:
            demand = Demand.whole(n, cpu, mem, models)
        else:
            demand = Demand(n, milli, 0, 0, False, cpu, mem, models)
        pods.append(
            TracePod(
                (row.get("name") or f"pod-{line}").strip(),
                demand,
                _int(p, line, row, "creation_time", -1, 2**62, default=-1),
                _int(p, line, row, "deletion_time", -1, 2**62, default=-1),
            )
        )
    return pods


def with_times_from(pods: Sequence[TracePod], donor: Sequence[TracePod], seed: int = 0) -> list[TracePod]:
    """``pods`` with the creation and deletion times of ``donor`` where they have none.

    The paper's variant lists (``multigpuNN`` ...) are the default list resampled and carry no timestamps. A pod
    that is a donor pod (same name and request) takes its times; any other takes those of a donor pod of the same
    GPU count (any, if none has it), drawn with ``seed``: a stand-in for when such a pod would have run.
    """
    timed = [p for p in donor if p.creation >= 0]
    if not timed:
        raise TraceError("the pod list to take times from has no creation times")
    by_name = {(p.name, p.demand): p for p in timed}
    by_count: dict[int, list[TracePod]] = {}
    for p in timed:
        by_count.setdefault(p.demand.count, []).append(p)
    rng = random.Random(seed)
    out = []
    for p in pods:
        if p.creation >= 0:
            out.append(p)
            continue
        same = by_name.get((p.name, p.demand))
        if same is None:
            pool = by_count.get(p.demand.count) or timed
            same = pool[rng.randrange(len(pool))]
        out.append(TracePod(p.name, p.demand, same.creation, same.deletion))
    return out
