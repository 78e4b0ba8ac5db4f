"""Topology files: a real machine's GPUs written down, so tests, demos and the simulator run
without one.

A file (YAML) names the node's CPU, memory and driver, a default GPU, the GPUs with their PCI
bus ids and NUMA nodes, the NVLink links, the MIG layout and, optionally, faults to replay.
:func:`load_topology` turns one into a :class:`Topology` (a :class:`NodeInventory` plus its
fault schedule). Shipped files live in ``topologies/`` and are selected by name
(``dgx-a100``); any other path works too. UUIDs not written in the file are derived from the
node name and GPU index, so they are stable across runs and distinct across nodes.

Format (every key optional unless marked)::

    name: dgx-a100                      # default node name
    node: {cpu: 256, memory: 2Ti, driverVersion: "550.54.15", cudaVersion: "12.4", labels: {}}
    gpu:                                # defaults for every GPU
      model: NVIDIA A100-SXM4-80GB      # required here or per GPU
      memory: 80Gi                      # quantity or MiB via memoryMiB
      computeCapability: "8.0"
      migCapable: true
    gpus:                               # required, one entry per GPU, in NVML index order
      - {pciBusId: "00000000:07:00.0", numa: 0}
      - {uuid: GPU-..., minor: 1, numa: 0, migEnabled: true,
         mig: [{profile: 3g.40gb, gi: 2, ci: 0}, {profile: 1g.10gb, gi: 9, ci: 0}]}
    nvlink:
      all: 12                           # every pair of GPUs (NVSwitch)
      pairs: [[0, 1, 2], [0, 4, 1]]     # GPU a, GPU b, links (added to / overriding `all`)
    faults:                             # see kubegpu.inventory.fake
      - {at: 2.0, kind: xid, gpu: 3, xid: 48}
"""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Final

import yaml

from kubegpu.inventory.base import InventoryError
from kubegpu.inventory.mig import PROFILE_RE, PROFILES, memory_gb, profile_spec, slices
from kubegpu.model import yaml_text
from kubegpu.model.inventory import Gpu, MigDevice, NodeInventory
from kubegpu.model.quantity import QuantityError, parse_int

# Namespace of the derived UUIDs; fixed so a topology gives the same UUIDs everywhere.
_UUID_NS: Final = uuidlib.UUID("6f1d9c3e-2b7a-4c55-9e61-0a4b8e2d7c10")
_MIB: Final = 2**20

FAULT_KINDS: Final = ("xid", "lost", "recover", "probe-fail", "discover-error", "wait-error")


class TopologyError(InventoryError):
    """A topology file that cannot be read; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One scheduled fault: at ``at`` seconds after the backend starts, do ``kind``.

    ``gpu`` is a GPU index or a GPU/MIG UUID; ``gi``/``ci`` pick a MIG device of that GPU.
    ``times`` bounds probe-fail and discover-error (``None`` = until a recover).
    """

    at: float
    kind: str
    gpu: int | str | None = None
    xid: int = 0
    gi: int | None = None
    ci: int | None = None
    times: int | None = None
    message: str = ""


@dataclass(frozen=True, slots=True)
class Topology:
    """A parsed topology file."""

    inventory: NodeInventory
    faults: tuple[Fault, ...] = ()
    source: str = ""


def shipped_topologies() -> list[str]:
    """Names of the topology files shipped with kubegpu."""
    root = resources.files("kubegpu.inventory") / "topologies"
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def resolve(name_or_path: str | Path) -> tuple[str, str]:
    """(source description, YAML text) of a shipped name or a file path."""
    text_name = str(name_or_path)
    path = Path(text_name)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists() or "/" in text_name:
        try:
            return str(path), path.read_text()
        except OSError as exc:
            raise TopologyError(f"cannot read topology file {path}: {exc.strerror or exc}") from exc
    root = resources.files("kubegpu.inventory") / "topologies" / f"{text_name}.yaml"
    if not root.is_file():
        raise TopologyError(
            f"unknown topology {text_name!r}: not a file, and not one of {', '.join(shipped_topologies())}")
    return f"topology {text_name}", root.read_text()


def load_topology(name_or_path: str | Path, node_name: str | None = None) -> Topology:
    """Load a shipped topology by name or any topology file by path."""
    source, text = resolve(name_or_path)
    try:
        data = yaml_text.load(text)
    except (yaml.YAMLError, yaml_text.TooDeep, RecursionError) as exc:
        raise TopologyError(f"{source}: not valid YAML: {str(exc)[:300]}") from None
    return parse_topology(data, node_name=node_name, source=source)


def derived_uuid(prefix: str, *parts: object) -> str:
    """A stable ``GPU-…``/``MIG-…`` UUID from a node name and positions."""
    return f"{prefix}-{uuidlib.uuid5(_UUID_NS, '/'.join(str(p) for p in parts))}"


class _Reader:
    """Typed access to a YAML mapping with errors that name the field's path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, msg: str) -> TopologyError:
        return TopologyError(f"{self.source}: {path}: {msg}")

    def mapping(self, value: Any, path: str, allowed: Sequence[str]) -> Mapping[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(path, f"expected a mapping, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                raise self.fail(f"{path}.{key}", f"unknown key (allowed: {', '.join(allowed)})")
        return value

    def integer(self, value: Any, path: str, minimum: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"expected an integer, got {value!r}")
        if value < minimum:
            raise self.fail(path, f"must be at least {minimum}, got {value}")
        return value

    def number(self, value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise self.fail(path, f"expected a number of seconds >= 0, got {value!r}")
        return float(value)

    def string(self, value: Any, path: str) -> str:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"expected a non-empty string, got {value!r}")
        return value

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"expected true or false, got {value!r}")
        return value

    def quantity(self, value: Any, path: str) -> int:
        try:
            n = parse_int(value)
        except QuantityError as exc:
            raise self.fail(path, str(exc)) from exc
        if n <= 0:
            raise self.fail(path, f"must be positive, got {value!r}")
        return n

    def capability(self, value: Any, path: str) -> tuple[int, int]:
        text = str(value)
        major, dot, minor = text.partition(".")
        if not dot or not major.isdigit() or not minor.isdigit():
            raise self.fail(path, f"expected <major>.<minor> such as \"8.0\", got {value!r}")
        return int(major), int(minor)


_GPU_KEYS: Final = ("uuid", "minor", "model", "memory", "memoryMiB", "computeCapability", "migCapable",
                    "numa", "pciBusId", "migEnabled", "mig", "healthy")


def parse_topology(data: Any, node_name: str | None = None, source: str = "topology") -> Topology:
    """Build a :class:`Topology` from the YAML data of a topology file."""
    r = _Reader(source)
    top = r.mapping(data, "topology", ("name", "description", "node", "gpu", "gpus", "nvlink", "faults"))
    if not top:
        raise r.fail("topology", "empty file")
    name = node_name or r.string(top.get("name", "node"), "name")
    node = r.mapping(top.get("node"), "node", ("cpu", "memory", "driverVersion", "cudaVersion", "labels"))
    defaults = r.mapping(top.get("gpu"), "gpu", _GPU_KEYS)
    raw_gpus = top.get("gpus")
    if not isinstance(raw_gpus, list) or not raw_gpus:
        raise r.fail("gpus", "expected a non-empty list of GPUs")

    labels = r.mapping(node.get("labels"), "node.labels", tuple(node.get("labels") or ()))
    gpus = [_parse_gpu(r, name, i, {**defaults, **r.mapping(g, f"gpus[{i}]", _GPU_KEYS)})
            for i, g in enumerate(raw_gpus)]
    uuids = [g.uuid for g in gpus]
    if len(set(uuids)) != len(uuids):
        raise r.fail("gpus", "duplicate GPU uuid")
    links = _parse_nvlink(r, top.get("nvlink"), len(gpus))
    gpus = [
        _with_links(g, {gpus[j].uuid: n for j, n in sorted(links.get(i, {}).items())})
        for i, g in enumerate(gpus)
    ]
    inventory = NodeInventory(
        name=name,
        gpus=tuple(gpus),
        cpu_milli=r.integer(node.get("cpu", 0), "node.cpu") * 1000,
        memory_bytes=r.quantity(node["memory"], "node.memory") if "memory" in node else 0,
        labels={str(k): str(v) for k, v in labels.items()},
        driver_version=str(node.get("driverVersion", "")),
        cuda_version=str(node.get("cudaVersion", "")),
    )
    faults = tuple(_parse_fault(r, f, i, len(gpus)) for i, f in enumerate(top.get("faults") or ()))
    return Topology(inventory=inventory, faults=faults, source=source)


def _with_links(g: Gpu, links: dict[str, int]) -> Gpu:
    from dataclasses import replace

    return replace(g, links=links)


def _parse_gpu(r: _Reader, node: str, i: int, g: Mapping[str, Any]) -> Gpu:
    path = f"gpus[{i}]"
    if "model" not in g:
        raise r.fail(f"{path}.model", "missing (set it in `gpu:` or per GPU)")
    model = r.string(g["model"], f"{path}.model")
    if "memoryMiB" in g:
        memory = r.integer(g["memoryMiB"], f"{path}.memoryMiB", 1) * _MIB
    elif "memory" in g:
        memory = r.quantity(g["memory"], f"{path}.memory")
    else:
        raise r.fail(f"{path}.memory", "missing (set it in `gpu:` or per GPU)")
    gpu_uuid = r.string(g["uuid"], f"{path}.uuid") if "uuid" in g else derived_uuid("GPU", node, i)
    if not gpu_uuid.startswith("GPU-"):
        raise r.fail(f"{path}.uuid", f"a GPU uuid starts with GPU-, got {gpu_uuid!r}")
    numa = g.get("numa")
    cc = None
    if "computeCapability" in g:
        cc = r.capability(g["computeCapability"], f"{path}.computeCapability")
    mig_entries = g.get("mig")
    mig_enabled = mig_entries is not None
    if "migEnabled" in g:
        mig_enabled = r.boolean(g["migEnabled"], f"{path}.migEnabled")
    if mig_entries is not None and not isinstance(mig_entries, list):
        raise r.fail(f"{path}.mig", "expected a list of MIG devices")
    if mig_entries and not mig_enabled:
        raise r.fail(f"{path}.mig", "MIG devices listed but migEnabled is false")
    migs = tuple(_parse_mig(r, node, i, gpu_uuid, model, memory, j, m, f"{path}.mig[{j}]")
                 for j, m in enumerate(mig_entries or ()))
    seen = set()
    for m in migs:
        if (m.gi, m.ci) in seen:
            raise r.fail(f"{path}.mig", f"duplicate gi {m.gi} / ci {m.ci}")
        seen.add((m.gi, m.ci))
    return Gpu(
        uuid=gpu_uuid,
        index=i,
        minor=r.integer(g.get("minor", i), f"{path}.minor"),
        model=model,
        memory_bytes=memory,
        healthy=r.boolean(g.get("healthy", True), f"{path}.healthy"),
        numa_node=None if numa is None else r.integer(numa, f"{path}.numa"),
        pci_bus_id=str(g.get("pciBusId") or f"00000000:{0x10 + i * 0x10 & 0xFF:02X}:00.0"),
        compute_capability=cc,
        mig_enabled=mig_enabled,
        mig_devices=migs,
        mig_capable=r.boolean(g.get("migCapable", mig_enabled), f"{path}.migCapable") or mig_enabled,
    )


def _parse_mig(r: _Reader, node: str, gpu_index: int, parent: str, model: str, total: int, j: int,
               m: Any, path: str) -> MigDevice:
    m = r.mapping(m, path, ("profile", "gi", "ci", "uuid", "memoryMiB", "attributes"))
    profile = r.string(m.get("profile"), f"{path}.profile")
    if PROFILE_RE.match(profile) is None:
        raise r.fail(f"{path}.profile", f"{profile!r} is not a MIG profile such as 3g.40gb")
    gi = r.integer(m.get("gi"), f"{path}.gi")
    ci = r.integer(m.get("ci", 0), f"{path}.ci")
    spec = profile_spec(model, profile)
    if spec is None and model in PROFILES and "memoryMiB" not in m:
        raise r.fail(f"{path}.profile",
                     f"{profile!r} is not a MIG profile of {model} (known: {', '.join(PROFILES[model])})")
    if "memoryMiB" in m:
        mem_mib = r.integer(m["memoryMiB"], f"{path}.memoryMiB", 1)
    elif spec is not None:
        mem_mib = spec.memory_mib
    else:
        # Unknown model: take the profile's own GB figure as the size.
        named = PROFILE_RE.match(profile)
        if named is None:  # checked above; kept for the type checker
            raise r.fail(f"{path}.profile", f"{profile!r} is not a MIG profile such as 3g.40gb")
        mem_mib = int(named["gb"]) * 1024
    gb = memory_gb(mem_mib, total)
    if f"g.{gb}gb" not in profile:
        raise r.fail(f"{path}.profile",
                     f"{profile!r} does not match its memory "
                     f"({mem_mib} MiB of {total // _MIB} MiB is {gb}gb)")
    g_slices, c_slices = slices(profile)
    attributes = dict(spec.attributes(g_slices, c_slices)) if spec is not None else {
        "slices.gi": g_slices, "slices.ci": c_slices}
    extra = m.get("attributes")
    for k, v in r.mapping(extra, f"{path}.attributes", tuple(extra or ())).items():
        attributes[str(k)] = r.integer(v, f"{path}.attributes.{k}")
    mig_uuid = derived_uuid("MIG", node, gpu_index, gi, ci)
    if "uuid" in m:
        mig_uuid = r.string(m["uuid"], f"{path}.uuid")
    return MigDevice(uuid=mig_uuid, profile=profile, parent_uuid=parent, gi=gi, ci=ci,
                     memory_bytes=mem_mib * _MIB, index=j, attributes=attributes)


def _parse_nvlink(r: _Reader, value: Any, n: int) -> dict[int, dict[int, int]]:
    spec = r.mapping(value, "nvlink", ("all", "pairs"))
    links: dict[int, dict[int, int]] = {}
    if "all" in spec:
        count = r.integer(spec["all"], "nvlink.all")
        for a in range(n):
            links[a] = {b: count for b in range(n) if b != a and count}
    for k, pair in enumerate(spec.get("pairs") or ()):
        path = f"nvlink.pairs[{k}]"
        if not isinstance(pair, list) or len(pair) != 3:
            raise r.fail(path, "expected [gpuA, gpuB, links]")
        a, b, count = (r.integer(x, path) for x in pair)
        if a >= n or b >= n or a == b:
            raise r.fail(path, f"GPUs must be two different indexes below {n}")
        for x, y in ((a, b), (b, a)):
            links.setdefault(x, {})
            if count:
                links[x][y] = count
            else:
                links[x].pop(y, None)
    return links


def _parse_fault(r: _Reader, f: Any, i: int, n: int) -> Fault:
    path = f"faults[{i}]"
    f = r.mapping(f, path, ("at", "kind", "gpu", "xid", "gi", "ci", "times", "message"))
    kind = r.string(f.get("kind", "xid"), f"{path}.kind")
    if kind not in FAULT_KINDS:
        raise r.fail(f"{path}.kind", f"{kind!r} is not one of {', '.join(FAULT_KINDS)}")
    gpu = f.get("gpu")
    if gpu is None and kind in ("xid", "lost", "recover", "probe-fail"):
        raise r.fail(f"{path}.gpu", f"a {kind} fault needs a gpu (index or uuid)")
    if isinstance(gpu, int) and not isinstance(gpu, bool) and not 0 <= gpu < n:
        raise r.fail(f"{path}.gpu", f"no GPU with index {gpu}")
    if gpu is not None and not isinstance(gpu, int | str):
        raise r.fail(f"{path}.gpu", f"expected an index or a uuid, got {gpu!r}")
    if kind == "xid" and "xid" not in f:
        raise r.fail(f"{path}.xid", "an xid fault needs an xid number")
    return Fault(
        at=r.number(f.get("at", 0), f"{path}.at"),
        kind=kind,
        gpu=gpu,
        xid=r.integer(f.get("xid", 79 if kind == "lost" else 0), f"{path}.xid"),
        gi=None if f.get("gi") is None else r.integer(f["gi"], f"{path}.gi"),
        ci=None if f.get("ci") is None else r.integer(f["ci"], f"{path}.ci"),
        times=None if f.get("times") is None else r.integer(f["times"], f"{path}.times", 1),
        message=str(f.get("message", "")),
    )
