"""NodePrepareResources / NodeUnprepareResources: claim -> CDI devices, idempotent and checkpointed.

The kubelet names a claim by namespace, name and UID only (recorded: nothing else is on the
wire); the allocation is read from the API server. Preparing a claim:

1. already in the checkpoint -> the recorded answer again (the kubelet prepares again after its
   own restart and after a failed container start), rewriting the CDI spec if it vanished
   (``/var/run/cdi`` is often a tmpfs);
2. otherwise GET the claim, check its UID (a deleted and recreated claim of the same name is
   refused), take the results for this driver and pool, and look each device up in what this
   node publishes;
3. write one CDI spec per claim (``k8s.gpu.kubegpu.io-claim_<uid>.json``, atomically) whose
   devices are ``<claim uid>-<device>[-<share id>]`` with the GPU's device nodes (a MIG device's
   capability nodes from the driver's mig-minors list, the device-plugin path's rule) and its
   ``/var/run/nvidia-container-devices/<uuid>`` mount, which add up over the claims a container
   uses, and whose
   claim-wide edits carry ``NVIDIA_VISIBLE_DEVICES``, ``KUBEGPU_VISIBLE_GPUS`` and for a share the
   same limits the device-plugin shares get (``KUBEGPU_GPU_CORE_PERCENT``,
   ``KUBEGPU_GPU_MEMORY_BYTES``; with MPS the share's daemon from ``node/mps``: its pipe directory,
   ``/dev/shm`` and ``CUDA_MPS_*`` limits, or a refusal when it cannot enforce the share);
4. record the claim in the checkpoint (one file per claim, atomic rename) before answering.

Unprepare removes the spec and the checkpoint entry; an unknown claim is already unprepared.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from kubegpu.model.quantity import QuantityError, parse_int
from kubegpu.node.container_edits import (
    CONTROL_DEVICES,
    VISIBLE_DEVICES,
    VOLUME_MOUNTS_HOST,
    VOLUME_MOUNTS_ROOT,
    ContainerEdits,
    SharePart,
    container_edits,
    read_mig_minors,
    unique,
)
from kubegpu.node.dra.names import CDI_CLASS, CDI_KIND, CDI_VENDOR, DRIVER, TYPE_GPU, TYPE_MIG, cdi_device_id
from kubegpu.node.dra.names import cdi_device_name as _cdi_name
from kubegpu.node.dra.slices import DraSettings, PublishedDevice
from kubegpu.node.mps.dra import DraEnforcement

log = logging.getLogger(__name__)

CDI_VERSION: Final = "0.6.0"
CHECKPOINT_KIND: Final = "KubegpuDraCheckpoint"
CHECKPOINT_VERSION: Final = 1
ENV_CLAIM: Final = "KUBEGPU_CLAIM"
ENV_DRIVER: Final = "KUBEGPU_DRIVER"
ENV_SHARE_IDS: Final = "KUBEGPU_SHARE_IDS"


class PrepareError(RuntimeError):
    """This claim cannot be prepared now; the message goes back to the kubelet, which retries."""


class ClaimReader(Protocol):
    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """The ResourceClaim as the API server has it; raises PrepareError when it cannot be read."""
        ...


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


def spec_file(spec: Mapping[str, Any]) -> bytes:
    """A CDI spec as its file holds it."""
    return json.dumps(spec, indent=1).encode()


@dataclass
class PreparedClaim:
    namespace: str
    name: str
    uid: str
    devices: list[PreparedDevice] = field(default_factory=list)
    # The CDI spec written for it, kept as the file's bytes, a fraction of its dicts and strings: the
    # daemon keeps one for every claim prepared on the node, so its memory grows with them.
    spec_file: bytes = b""

    @property
    def spec(self) -> dict[str, Any]:
        return json.loads(self.spec_file) if self.spec_file else {}

    def as_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "name": self.name, "uid": self.uid,
                "devices": [asdict(d) for d in self.devices], "spec": self.spec}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PreparedClaim:
        devs = [PreparedDevice(tuple(x["request_names"]), x["pool"], x["device"], tuple(x["cdi_device_ids"]),
                               x.get("share_id")) for x in d.get("devices", [])]
        spec = d.get("spec") or {}
        return cls(str(d["namespace"]), str(d["name"]), str(d["uid"]), devs, spec_file(spec) if spec else b"")


def _atomic_write(path: Path, data: bytes, mode: int = 0o644, sync: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class Checkpoint:
    """The prepared claims on disk: one small file per claim under ``<state dir>/claims/`` (written
    atomically before the kubelet is answered), so a prepare costs one write whatever the number of
    claims, and a daemon restart loses nothing."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.path = self.dir  # for messages

    def _file(self, uid: str) -> Path:
        if not uid or "/" in uid or uid.startswith("."):
            raise PrepareError(f"claim UID {uid!r} cannot name a checkpoint file")
        return self.dir / f"{uid}.json"

    def load(self) -> dict[str, PreparedClaim]:
        out: dict[str, PreparedClaim] = {}
        try:
            files = sorted(self.dir.glob("*.json"))
        except OSError as exc:
            raise PrepareError(f"checkpoint {self.dir} cannot be read: {exc}") from exc
        for f in files:
            try:
                raw = json.loads(f.read_text())
            except (OSError, ValueError) as exc:
                raise PrepareError(f"checkpoint {f} cannot be read: {exc}") from exc
            if not isinstance(raw, dict) or raw.get("kind") != CHECKPOINT_KIND:
                raise PrepareError(f"checkpoint {f} is not a {CHECKPOINT_KIND}")
            if raw.get("version") != CHECKPOINT_VERSION:
                raise PrepareError(f"checkpoint {f}: unsupported version {raw.get('version')!r}")
            try:
                c = PreparedClaim.from_dict(raw["claim"])
            except (KeyError, TypeError) as exc:
                raise PrepareError(f"checkpoint {f}: malformed entry ({exc})") from exc
            out[c.uid] = c
        return out

    def save(self, claim: PreparedClaim) -> None:
        body = {"kind": CHECKPOINT_KIND, "version": CHECKPOINT_VERSION, "claim": claim.as_dict()}
        # No fsync: the file only has to survive a process restart (the page cache does that). After a
        # power loss it may be missing, and that is harmless: the claim's allocation is in the API
        # server, so a prepare rebuilds the same answer, and an unprepare of an unknown claim is a no-op.
        _atomic_write(self._file(claim.uid), json.dumps(body, separators=(",", ":")).encode(), 0o600, sync=False)

    def remove(self, uid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._file(uid).unlink()


def cdi_spec_path(cdi_dir: str | os.PathLike[str], claim_uid: str) -> Path:
    return Path(cdi_dir) / f"{CDI_VENDOR}-claim_{claim_uid}.json"


def _quantity(value: Any, what: str) -> int:
    try:
        return parse_int(value)
    except (QuantityError, ValueError, TypeError) as exc:
        raise PrepareError(f"{what}: {value!r} is not a quantity") from exc


def _device_list_mount(uuid: str) -> dict[str, Any]:
    """NVIDIA's ``volume-mounts`` device list entry (``/dev/null`` at ``/var/run/nvidia-container-devices/<uuid>``):
    the container toolkit reads the container's GPUs from these when it accepts volume mounts, and
    mounts of several claims add up."""
    return {"hostPath": VOLUME_MOUNTS_HOST, "containerPath": f"{VOLUME_MOUNTS_ROOT}/{uuid}",
            "options": ["ro", "nosuid", "nodev", "bind"]}


def share_limits(dev: PublishedDevice, result: Mapping[str, Any]) -> tuple[int, int] | None:
    """(compute percent, memory bytes) when the allocation ``result`` is a share of ``dev``; None when it
    holds the device whole (an exclusive device, or one whose allocation consumed all its capacity, as a
    claim naming no capacity does). The one rule for "is this a share" (env, MPS limits)."""
    consumed = result.get("consumedCapacity")
    if not consumed or not dev.share_memory_max:
        return None
    got = {"compute": _quantity(consumed.get("compute", "100"), f"{dev.name} compute"),
           "memory": _quantity(consumed.get("memory", dev.memory_bytes), f"{dev.name} memory")}
    if dev.whole(got):
        return None
    return got["compute"], got["memory"]


class Preparer:
    """Prepares and unprepares claims for the devices ``table()`` says this node publishes."""

    def __init__(self, reader: ClaimReader, table: Callable[[], Mapping[str, PublishedDevice]],
                 settings: DraSettings, *, cdi_dir: str | os.PathLike[str], state_dir: str | os.PathLike[str],
                 enforcer: DraEnforcement | None = None) -> None:
        self.reader = reader
        self.enforcer = enforcer  # MPS: what holds a share to its limits (node/mps)
        self.table = table
        self.settings = settings
        self.cdi_dir = Path(cdi_dir)
        self.checkpoint = Checkpoint(Path(state_dir) / "claims")
        self._lock = threading.Lock()
        self._claim_locks: dict[str, threading.Lock] = {}
        self.claims: dict[str, PreparedClaim] = self.checkpoint.load()

    def _claim_lock(self, uid: str) -> threading.Lock:
        with self._lock:
            return self._claim_locks.setdefault(uid, threading.Lock())

    # ----- prepare ---------------------------------------------------------------------------

    def prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        if not (namespace and uid and name):
            raise PrepareError("a claim needs namespace, uid and name")
        with self._claim_lock(uid):
            have = self.claims.get(uid)
            if have is not None:
                path = cdi_spec_path(self.cdi_dir, uid)
                if not path.exists():
                    log.info("claim %s/%s: CDI spec gone; writing it again", namespace, name)
                    self._write_spec(uid, have.spec_file)
                return have.devices
            claim = self.reader.get_claim(namespace, name)
            prepared = self._build(claim, namespace, uid, name)
            try:
                self._write_spec(uid, prepared.spec_file)
                try:
                    self.checkpoint.save(prepared)
                except OSError as exc:
                    with contextlib.suppress(FileNotFoundError):
                        cdi_spec_path(self.cdi_dir, uid).unlink()
                    raise PrepareError(f"cannot write checkpoint {self.checkpoint.dir}: {exc}") from exc
            except PrepareError:
                self._let_go(uid, self._gpus(prepared))
                raise
            with self._lock:
                self.claims[uid] = prepared
            return prepared.devices

    def _build(self, claim: Mapping[str, Any], namespace: str, uid: str, name: str) -> PreparedClaim:
        meta = claim.get("metadata") or {}
        if meta.get("uid") != uid:
            raise PrepareError(f"ResourceClaim {namespace}/{name} has UID {meta.get('uid')!r}, not {uid!r} "
                               "(deleted and created again?)")
        alloc = (claim.get("status") or {}).get("allocation")
        if not alloc:
            raise PrepareError(f"ResourceClaim {namespace}/{name} is not allocated")
        results = [r for r in ((alloc.get("devices") or {}).get("results") or []) if r.get("driver") == DRIVER]
        table = self.table()
        devices: list[PreparedDevice] = []
        used: list[tuple[PublishedDevice, dict[str, Any]]] = []
        for r in results:
            pool, dname, req = r.get("pool", ""), r.get("device", ""), r.get("request", "")
            if pool != self.settings.pool:
                raise PrepareError(f"ResourceClaim {namespace}/{name}: device {dname} is in pool {pool!r}, "
                                   f"not this node's pool {self.settings.pool!r}")
            dev = table.get(dname)
            if dev is None:
                raise PrepareError(f"ResourceClaim {namespace}/{name}: device {dname} is not published "
                                   f"by node {self.settings.node_name}")
            share = r.get("shareID") or None
            devices.append(PreparedDevice((req,) if req else (), pool, dname,
                                          (cdi_device_id(uid, dname, share),), share))
            used.append((dev, r))
        return PreparedClaim(namespace, name, uid, devices, spec_file(self._spec(namespace, name, uid, used)))

    def _gpus(self, claim: PreparedClaim) -> list[str]:
        """The GPUs (by UUID) a prepared claim holds, as far as this node still publishes them."""
        table = self.table()
        return unique(table[d.device].gpu_uuid for d in claim.devices if d.device in table)

    def _let_go(self, uid: str, gpus: Sequence[str]) -> None:
        """Strict: claim ``uid`` no longer holds ``gpus`` (shares and whole alike: both are no-ops where it
        held none), so a GPU left without holders gets its compute mode back."""
        if self.enforcer is None:
            return
        self.enforcer.release(uid, gpus)
        for u in gpus:
            self.enforcer.release_whole(u, uid)

    def _edits(self, namespace: str, name: str, uid: str,
               used: list[tuple[PublishedDevice, dict[str, Any]]]) -> tuple[ContainerEdits, list[str]]:
        """The claim's container edits (one device each per allocation result), and its share IDs. Under
        strict enforcement the claim (by ``uid``) enters its GPUs: a share joins its GPU's one server, a whole
        GPU is claimed (refused while shares hold it, its mode put back)."""
        minors = read_mig_minors(self.settings.mig_minors_file) if any(
            d.type == TYPE_MIG for d, _ in used) else {}
        shares: list[SharePart] = []
        share_ids: list[str] = []
        for dev, r in used:
            limits = share_limits(dev, r)
            if limits is not None:
                shares.append((dev.gpu_uuid, *limits))
                if r.get("shareID"):
                    share_ids.append(r["shareID"])
        bound = None
        if shares and self.settings.mps:
            if self.enforcer is None:
                raise PrepareError(f"ResourceClaim {namespace}/{name}: MPS is on but no MPS daemon runs here")
            order = [g for g, _, _ in shares]
            try:
                bound = self.enforcer.for_share(shares, order, holder=uid)
            except RuntimeError as exc:  # MpsError
                raise PrepareError(f"ResourceClaim {namespace}/{name}: share cannot be enforced: {exc}") from exc
        whole = [d.gpu_uuid for d, r in used if d.type == TYPE_GPU and share_limits(d, r) is None]
        if whole and self.enforcer is not None:
            claimed: list[str] = []
            try:
                for u in whole:
                    self.enforcer.claim_whole(u, uid)
                    claimed.append(u)
            except RuntimeError as exc:  # MpsError: strict shares hold the GPU
                self._let_go(uid, [*claimed, *(g for g, _, _ in shares)])
                raise PrepareError(f"ResourceClaim {namespace}/{name}: the GPU cannot be given whole now: "
                                   f"{exc}") from exc
        edits = container_edits([(dev.uuid, dev) for dev, _ in used], unique(d.gpu_uuid for d, _ in used),
                                shares, bound, minors=minors)
        return edits, share_ids

    def _spec(self, namespace: str, name: str, uid: str,
              used: list[tuple[PublishedDevice, dict[str, Any]]]) -> dict[str, Any]:
        """The claim's edits as its CDI spec."""
        edits, share_ids = self._edits(namespace, name, uid, used)
        cdi_devices: list[dict[str, Any]] = []
        for (dev, r), dev_edits in zip(used, edits.devices, strict=True):
            # Per device, what adds up when a container uses several claims: its device nodes and its
            # entry in the toolkit's volume-mount device list (environment variables do not add up: the
            # runtime applies the claims' specs in turn and a later value replaces an earlier one).
            cdi_devices.append({"name": _cdi_name(uid, dev.name, r.get("shareID") or None),
                                "containerEdits": {"deviceNodes": [{"path": p} for p in dev_edits.nodes],
                                                   "env": [f"KUBEGPU_REQUEST={r.get('request', '')}"],
                                                   "mounts": [_device_list_mount(dev.uuid)]}})
        visible = edits.names
        env = [f"{ENV_DRIVER}={DRIVER}", f"{ENV_CLAIM}={namespace}/{name}",
               f"{VISIBLE_DEVICES}={','.join(visible) if visible else 'void'}"]
        env += [f"{k}={v}" for k, v in edits.env()]
        if share_ids:
            env.append(f"{ENV_SHARE_IDS}={','.join(share_ids)}")
        claim_edits: dict[str, Any] = {"deviceNodes": [{"path": p} for p in CONTROL_DEVICES]}
        if edits.mps is not None:
            claim_edits["mounts"] = [{"hostPath": h, "containerPath": c, "options": ["rbind", "rw"]}
                                     for h, c in edits.mps_mounts()]
        claim_edits["env"] = env
        return {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": cdi_devices, "containerEdits": claim_edits}

    def _write_spec(self, uid: str, spec: bytes) -> None:
        try:
            # /var/run/cdi is a tmpfs: rename keeps readers safe, an fsync would buy nothing.
            _atomic_write(cdi_spec_path(self.cdi_dir, uid), spec, sync=False)
        except OSError as exc:
            raise PrepareError(f"cannot write CDI spec to {self.cdi_dir}: {exc}") from exc

    # ----- unprepare -------------------------------------------------------------------------

    def unprepare(self, namespace: str, uid: str, name: str) -> None:
        with self._claim_lock(uid):
            have = self.claims.get(uid)
            if have is not None:
                self._let_go(uid, self._gpus(have))
            with contextlib.suppress(FileNotFoundError):
                cdi_spec_path(self.cdi_dir, uid).unlink()
            try:
                self.checkpoint.remove(uid)
            except OSError as exc:
                raise PrepareError(f"cannot update checkpoint {self.checkpoint.dir}: {exc}") from exc
            with self._lock:
                self.claims.pop(uid, None)
                self._claim_locks.pop(uid, None)

    def prepared(self) -> dict[str, PreparedClaim]:
        with self._lock:
            return dict(self.claims)


__all__ = ["CDI_CLASS", "Checkpoint", "ClaimReader", "PrepareError", "PreparedClaim", "PreparedDevice",
           "Preparer", "cdi_spec_path"]
