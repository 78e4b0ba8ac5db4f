"""What one MPS control daemon enforces, and what a container served by it gets: pure values, no I/O.

Only a control daemon's defaults bind a client (measured on an H200, docs/sharing.md: a client asking
100 % / 140G in its environment got the defaults 25 % / 16G; the environment can only lower them). So
every share kubegpu serves through MPS is served by a daemon whose defaults *are* that share:

- MPS replicas (``sharing.mps``, NVIDIA's meaning): one daemon per resource, defaults 100/replicas percent
  and each GPU's memory / replicas, as NVIDIA's plugin sets them;
- fine-grained shares (device-plugin shares with their record, DRA consumable-capacity shares): one daemon
  per *share shape*, the GPUs a share spans with the percent and memory it holds on each. Shares of the same
  shape on the same GPUs share a server (they run concurrently, as MPS replicas do); shares of different
  shapes get different servers, which time-slice with each other on a GPU.

The daemon name is derived from its shape alone, so a restarted node daemon, a second Allocate of the same
shape and the DRA driver all reach the same daemon, and its defaults can never differ from its name.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from kubegpu.model.share_shape import ShareShape, memory_mib

CONTAINER_ROOT: Final = "/mps"  # where a container finds its pipe directory
DEFAULT_PIPE_DIR: Final = "/tmp/nvidia-mps"  # where CUDA looks when CUDA_MPS_PIPE_DIRECTORY is unset
SHM_DIR: Final = "shm"  # <mps root>/shm: one tmpfs the servers and every client share as /dev/shm
NAME_RE: Final = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")

ENV_PIPE: Final = "CUDA_MPS_PIPE_DIRECTORY"
ENV_LOG: Final = "CUDA_MPS_LOG_DIRECTORY"
ENV_THREADS: Final = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_MEMORY: Final = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"


class ShareShapeError(ValueError):
    """A share that one MPS daemon cannot enforce as recorded (the message says why)."""


@dataclass(frozen=True, slots=True)
class GpuLimit:
    """One GPU a daemon serves and the pinned device memory each of its clients may hold there."""

    uuid: str
    memory_mib: int


@dataclass(frozen=True, slots=True)
class DaemonSpec:
    """One control daemon: its directory name under the MPS root, its GPUs and its defaults."""

    name: str
    gpus: tuple[GpuLimit, ...]
    thread_percentage: int
    kind: str  # "replicas" or "share", for status and logs

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ShareShapeError(f"MPS daemon name {self.name!r} is not a plain directory name")
        if not self.gpus:
            raise ShareShapeError(f"MPS daemon {self.name}: no GPUs")
        if not 1 <= self.thread_percentage <= 100:
            raise ShareShapeError(f"MPS daemon {self.name}: thread percentage {self.thread_percentage} "
                                  "is outside 1..100")
        if any(g.memory_mib < 1 for g in self.gpus):
            raise ShareShapeError(f"MPS daemon {self.name}: a memory limit below 1 MiB")

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(g.uuid for g in self.gpus)

    def default_commands(self) -> list[str]:
        """What the control daemon is told before any client connects (GPUs by UUID: unambiguous
        whatever the daemon's or the client's device order; applied on the H200, docs/sharing.md)."""
        cmds = [f"set_default_active_thread_percentage {self.thread_percentage}"]
        cmds += [f"set_default_device_pinned_mem_limit {g.uuid} {g.memory_mib}M" for g in self.gpus]
        return cmds

    def describe(self) -> str:
        mem = ",".join(f"{g.memory_mib}M" for g in self.gpus)
        return f"{self.thread_percentage}% / {mem}"

    def shape_on(self, uuid: str) -> ShareShape:
        """What this daemon's server enforces on GPU ``uuid`` (model/share_shape.py: the key strict
        enforcement locks a GPU by, as the placement core and the extender do)."""
        limit = next(g for g in self.gpus if g.uuid == uuid)
        return ShareShape(self.thread_percentage, limit.memory_mib, len(self.gpus))


@dataclass(frozen=True, slots=True)
class Binding:
    """What a container served by one daemon gets: its environment and its mounts (host -> container)."""

    daemon: str
    env: tuple[tuple[str, str], ...]
    mounts: tuple[tuple[str, str], ...]


def replica_spec(resource: str, gpus: Sequence[tuple[str, int]], replicas: int) -> DaemonSpec:
    """NVIDIA's daemon for an MPS replica resource: ``gpus`` are (uuid, memory bytes) of its GPUs."""
    if replicas < 2:
        raise ShareShapeError(f"{resource}: MPS replicas need at least 2 per GPU, got {replicas}")
    uniq = dict(gpus)
    return DaemonSpec(name=resource.replace("/", "_"), kind="replicas", thread_percentage=max(1, 100 // replicas),
                      gpus=tuple(GpuLimit(u, memory_mib(m // replicas)) for u, m in uniq.items()))


def share_spec(parts: Sequence[tuple[str, int, int]]) -> DaemonSpec:
    """The daemon for one share shape: ``parts`` are (GPU uuid, core percent, memory bytes) in the
    container's device order. Every GPU of a share holds the same percent (the request rules split it
    evenly); a share with different percents per GPU cannot be one daemon's default and is refused."""
    if not parts:
        raise ShareShapeError("a share with no GPUs")
    cores = {c for _, c, _ in parts}
    if len(cores) != 1:
        raise ShareShapeError(f"share holds different compute percents on its GPUs ({sorted(cores)}): "
                              "one MPS daemon has one active-thread default")
    core = cores.pop()
    uuids = [u for u, _, _ in parts]
    if len(set(uuids)) != len(uuids):
        raise ShareShapeError("share names one GPU twice")
    gpus = tuple(GpuLimit(u, memory_mib(m)) for u, _, m in parts)
    shape = ";".join(f"{g.uuid}={g.memory_mib}" for g in sorted(gpus, key=lambda g: g.uuid))
    digest = hashlib.sha256(f"{core}|{shape}".encode()).hexdigest()[:10]
    mem = "-".join(str(g.memory_mib) for g in gpus) if len(gpus) <= 4 else f"{len(gpus)}gpus"
    return DaemonSpec(name=f"share-c{core}-m{mem}-{digest}"[:100], gpus=gpus, thread_percentage=core,
                      kind="share")


def binding(spec: DaemonSpec, mps_root: str, order: Sequence[str] | None = None) -> Binding:
    """The container side of ``spec``: the pipe directory (also at CUDA's default path, so a container that
    unsets the variable still reaches the server), the shared ``/dev/shm``, and the limits repeated in the
    environment (informative: the daemon's defaults already hold them, and the environment can only lower
    them). ``order`` is the container's visible GPU order; memory limits are given by that ordinal."""
    host = f"{mps_root.rstrip('/')}/{spec.name}"
    pipe = f"{CONTAINER_ROOT}/{spec.name}/pipe"
    by_uuid = {g.uuid: g for g in spec.gpus}
    seq = [u for u in (order or spec.uuids) if u in by_uuid]
    env = ((ENV_PIPE, pipe), (ENV_THREADS, str(spec.thread_percentage)),
           (ENV_MEMORY, ",".join(f"{i}={by_uuid[u].memory_mib}M" for i, u in enumerate(seq))))
    mounts = ((f"{host}/pipe", pipe), (f"{host}/pipe", DEFAULT_PIPE_DIR),
              (f"{mps_root.rstrip('/')}/{SHM_DIR}", "/dev/shm"))
    return Binding(daemon=spec.name, env=env, mounts=mounts)
