"""One node's free GPUs, and whether (and where) a pod's GPU request fits on it.

:func:`fit` answers for every request kind (whole GPUs, MIG devices, replicas,
fine-grained shares over one or k GPUs) with the pod's CPU and memory, its
allowed GPU models and GPU health. It never changes the state: the answer
carries a :class:`PodChoice`, which :meth:`NodeState.apply` commits (all or
nothing) and :meth:`NodeState.release` undoes. A choice converts to the
``kubegpu.io/device-allocated`` annotation's :class:`PodAllocation`, and a
state can be rebuilt from the annotations of the pods already on the node.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation
from kubegpu.model.inventory import Gpu, MigDevice, NodeInventory
from kubegpu.model.request import ContainerRequest, GpuRequest, PodRequest, RequestKind
from kubegpu.placement.cluster import MILLI, ClusterState, Demand
from kubegpu.placement.engine import choose_gpus
from kubegpu.placement.policies import Policy, ScoreContext

# CPU (millicores) or memory (bytes) of a node whose inventory does not say: never the limit.
UNKNOWN_CAPACITY = 1 << 50


class PlacementConflict(ValueError):
    """A choice or allocation no longer fits the node (a race, or a stale view); nothing was changed."""


@dataclass(frozen=True, slots=True)
class ContainerChoice:
    """The GPUs chosen for one container: the grants the annotation will carry."""

    container: str
    init: bool
    grants: tuple[DeviceGrant, ...]


@dataclass(frozen=True, slots=True)
class PodChoice:
    """The GPUs chosen for every GPU container of a pod on one node."""

    node: str
    containers: tuple[ContainerChoice, ...]

    def to_allocation(self) -> PodAllocation:
        """The ``kubegpu.io/device-allocated`` value (see :mod:`kubegpu.model.allocation`)."""
        return PodAllocation(tuple(ContainerAllocation(c.container, c.grants, c.init) for c in self.containers))

    def gpu_uuids(self) -> tuple[str, ...]:
        """Every GPU the pod touches, in grant order, without repeats."""
        return tuple(dict.fromkeys(g.uuid for c in self.containers for g in c.grants))


@dataclass(frozen=True, slots=True)
class Fit:
    """Whether a pod fits a node; ``reason`` says why not (or what was chosen) in words."""

    ok: bool
    reason: str
    choice: PodChoice | None = None

    def __bool__(self) -> bool:
        return self.ok


def _pct(milli: int) -> str:
    return f"{milli // 10} %"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


class NodeState:
    """Free capacity of one node: per-GPU compute and memory, free MIG devices, CPU and memory.

    Built empty from a :class:`NodeInventory`; add the pods already there with
    :meth:`apply_allocation`. Mutating methods are all-or-nothing.
    """

    def __init__(self, inventory: NodeInventory) -> None:
        self.inventory = inventory
        self.gpus: tuple[Gpu, ...] = tuple(sorted(inventory.gpus, key=lambda g: g.index))
        self.arrays = ClusterState.from_inventories([inventory], max_gpus=max(1, len(self.gpus)))
        a = self.arrays
        if a.cpu_cap[0] <= 0:  # not published: CPU is then kube-scheduler's business alone
            a.cpu_cap[0] = a.cpu_free[0] = UNKNOWN_CAPACITY
        if a.mem_cap[0] <= 0:
            a.mem_cap[0] = a.mem_free[0] = UNKNOWN_CAPACITY
        self._slot = {g.uuid: i for i, g in enumerate(self.gpus)}
        self._mig: dict[str, tuple[Gpu, MigDevice]] = {
            m.uuid: (g, m) for g in self.gpus if g.mig_enabled for m in g.mig_devices
        }
        self.mig_free: set[str] = {u for u, (g, m) in self._mig.items() if g.healthy and m.healthy}

    # ---- views --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.inventory.name

    @property
    def cpu_free_milli(self) -> int:
        return int(self.arrays.cpu_free[0])

    @property
    def memory_free_bytes(self) -> int:
        return int(self.arrays.mem_free[0])

    def core_free(self, uuid: str) -> int:
        """Free compute of a GPU in percent (0 when unhealthy or MIG-enabled)."""
        return int(self.arrays.core_free[0, self._slot[uuid]]) // 10

    def memory_free(self, uuid: str) -> int:
        """Free memory of a GPU in bytes (0 when unhealthy or MIG-enabled)."""
        return int(self.arrays.gmem_free[0, self._slot[uuid]])

    def copy(self) -> NodeState:
        out = NodeState.__new__(NodeState)
        out.inventory, out.gpus, out._slot, out._mig = self.inventory, self.gpus, self._slot, self._mig
        out.arrays = self.arrays.copy()
        out.mig_free = set(self.mig_free)
        return out

    # ---- commit -------------------------------------------------------------------------------
    def apply(self, choice: PodChoice, cpu_milli: int = 0, memory_bytes: int = 0) -> None:
        """Commit a choice from :func:`fit` (init containers' grants are not held)."""
        self.apply_allocation(_held(choice), cpu_milli, memory_bytes)

    def release(self, choice: PodChoice, cpu_milli: int = 0, memory_bytes: int = 0) -> None:
        """Undo :meth:`apply`."""
        self.release_allocation(_held(choice), cpu_milli, memory_bytes)

    def apply_allocation(self, alloc: PodAllocation, cpu_milli: int = 0, memory_bytes: int = 0,
                         force: bool = False) -> None:
        """Hold an allocation (a choice, or a pod's annotation). Raises :class:`PlacementConflict`;
        with ``force`` (a live record colliding with others) it is held anyway and the GPU's free
        part may go below zero: full for new placements, and exact again when either pod leaves."""
        trial = self.copy()
        trial._take(alloc, cpu_milli, memory_bytes, force)
        self.arrays, self.mig_free = trial.arrays, trial.mig_free

    def release_allocation(self, alloc: PodAllocation, cpu_milli: int = 0, memory_bytes: int = 0) -> None:
        """Give an allocation back (a departed pod). Unknown GPUs are skipped; never above capacity."""
        a = self.arrays
        a.cpu_free[0] = min(a.cpu_cap[0], a.cpu_free[0] + cpu_milli)
        a.mem_free[0] = min(a.mem_cap[0], a.mem_free[0] + memory_bytes)
        a.touch(0)
        for g in alloc.grants():
            if g.mig_uuid is not None:
                if g.mig_uuid in self._mig:
                    self.mig_free.add(g.mig_uuid)
                continue
            j = self._slot.get(g.uuid)
            if j is None or not a.gpu_ok[0, j]:
                continue
            a.core_free[0, j] = min(MILLI, a.core_free[0, j] + g.core * 10)
            a.gmem_free[0, j] = min(a.gmem_cap[0, j], a.gmem_free[0, j] + g.memory_bytes)

    def _take(self, alloc: PodAllocation, cpu_milli: int, memory_bytes: int, force: bool = False) -> None:
        a = self.arrays
        if not force and (cpu_milli > a.cpu_free[0] or memory_bytes > a.mem_free[0]):
            raise PlacementConflict(f"{self.name}: CPU or memory no longer free")
        a.cpu_free[0] -= cpu_milli
        a.mem_free[0] -= memory_bytes
        a.touch(0)
        for g in alloc.grants():
            if g.mig_uuid is not None:
                if g.mig_uuid not in self.mig_free and not force:
                    raise PlacementConflict(f"{self.name}: MIG device {g.mig_uuid} is not free")
                self.mig_free.discard(g.mig_uuid)
                continue
            j = self._slot.get(g.uuid)
            if j is None:
                if force:
                    continue
                raise PlacementConflict(f"{self.name}: no GPU {g.uuid}")
            if force:
                if not a.gpu_ok[0, j]:
                    continue  # as release_allocation skips it
                a.core_free[0, j] -= g.core * 10
                a.gmem_free[0, j] -= g.memory_bytes
                continue
            if not a.gpu_ok[0, j]:
                raise PlacementConflict(f"{self.name}: GPU {self.gpus[j].index} is unhealthy or MIG-enabled")
            if a.core_free[0, j] < g.core * 10 or a.gmem_free[0, j] < g.memory_bytes:
                raise PlacementConflict(
                    f"{self.name}: GPU {self.gpus[j].index}: {_pct(int(a.core_free[0, j]))} compute and "
                    f"{_gib(int(a.gmem_free[0, j]))} free, {g.core} % and {_gib(g.memory_bytes)} asked"
                )
            a.core_free[0, j] -= g.core * 10
            a.gmem_free[0, j] -= g.memory_bytes

    @classmethod
    def rebuild(
        cls, inventory: NodeInventory, pods: Iterable[tuple[PodAllocation, int, int]]
    ) -> tuple[NodeState, list[str]]:
        """A state with the given (allocation, CPU, memory) already held; returns the conflicts skipped."""
        state = cls(inventory)
        problems: list[str] = []
        for alloc, cpu, mem in pods:
            try:
                state.apply_allocation(alloc, cpu, mem)
            except PlacementConflict as exc:
                problems.append(str(exc))
        return state, problems


def _held(choice: PodChoice) -> PodAllocation:
    return choice.to_allocation().held()  # Kubernetes' init-container rule (model.allocation)


_MIG_G = re.compile(r"(?:\d+c\.)?(\d+)g\.")


def request_demand(req: GpuRequest, models: frozenset[str] | None = None) -> Demand:
    """The array-level demand of one container's GPU request (MIG and replicas have none: count 0)."""
    if req.kind is RequestKind.WHOLE or (req.kind is RequestKind.SHARE and req.exclusive):
        return Demand.whole(req.count, models=models)
    if req.kind is RequestKind.SHARE:
        return Demand(req.count, req.core * 10, req.memory_bytes or 0, req.memory_ratio or 0, False, 0, 0, models)
    return Demand(models=models)


def fit(
    state: NodeState,
    request: PodRequest,
    cpu_milli: int = 0,
    memory_bytes: int = 0,
    gpu_policy: str | Policy = "kubegpu",
    ctx: ScoreContext | None = None,
) -> Fit:
    """Whether ``request`` fits ``state`` with the pod's CPU and memory, and on which GPUs.

    App containers are placed one after another on the same node; each init
    container must fit on its own (it runs before them and its grants are not
    held once it ends). Pure: ``state`` is not changed.
    """
    if not request.ok:
        return Fit(False, "request refused: " + "; ".join(str(r) for r in request.refusals))
    if cpu_milli > state.cpu_free_milli:
        return Fit(False, f"{state.name}: {cpu_milli}m CPU requested, {state.cpu_free_milli}m free")
    if memory_bytes > state.memory_free_bytes:
        return Fit(
            False,
            f"{state.name}: {_gib(memory_bytes)} memory requested, {_gib(state.memory_free_bytes)} free",
        )
    containers = request.gpu_containers
    if not containers:
        return Fit(True, f"{state.name}: no GPU requested", PodChoice(state.name, ()))
    models = request.allowed_models
    if models is not None:
        present = {g.model for g in state.gpus}
        if not present & models:
            return Fit(
                False,
                f"{state.name}: GPU model {', '.join(sorted(present)) or 'none'} "
                f"not in the allowed {', '.join(sorted(models))}",
            )
    ctx = ctx or ScoreContext()
    scratch = state.copy()
    chosen: list[ContainerChoice] = []
    reusable: dict[str, list[DeviceGrant]] = {}  # the kubelet's devicesToReuse, per resource
    for c in containers:
        base = state.copy() if c.init else scratch
        pool = reusable.get(c.request.resource, []) if c.request is not None and not c.init else []
        if pool:
            grants, why = _fit_reusing(base, c, pool, models, gpu_policy, ctx)
        else:
            grants, why = _fit_container(base, c, models, gpu_policy, ctx)
        if grants is not None and c.request is not None and c.request.kind is not RequestKind.REPLICA:
            res = c.request.resource
            if c.init:
                have = {g.mig_uuid or g.uuid for g in reusable.get(res, [])}
                reusable.setdefault(res, []).extend(g for g in grants if (g.mig_uuid or g.uuid) not in have)
            else:
                used = {g.mig_uuid or g.uuid for g in grants}
                reusable[res] = [g for g in reusable.get(res, []) if (g.mig_uuid or g.uuid) not in used]
        if grants is None:
            return Fit(False, f"{state.name}: container {c.name!r}: {why}")
        choice = ContainerChoice(c.name, c.init, grants)
        if not c.init:
            try:
                scratch._take(PodAllocation((ContainerAllocation(c.name, grants),)), 0, 0)
            except PlacementConflict as exc:  # cannot happen when fit is right; say so rather than crash
                return Fit(False, f"{state.name}: container {c.name!r}: {exc}")
        chosen.append(choice)
    pod = PodChoice(state.name, tuple(chosen))
    where = ", ".join(f"{c.container}: GPU " + ",".join(str(g.minor) for g in c.grants) for c in chosen if c.grants)
    return Fit(True, f"{state.name}: fits ({where or 'no specific GPU'})", pod)


def _fit_container(
    state: NodeState,
    c: ContainerRequest,
    models: frozenset[str] | None,
    gpu_policy: str | Policy,
    ctx: ScoreContext,
) -> tuple[tuple[DeviceGrant, ...] | None, str]:
    req = c.request
    assert req is not None
    allowed = [models is None or g.model in models for g in state.gpus]
    if req.kind is RequestKind.MIG:
        return _fit_mig(state, req, allowed)
    if req.kind is RequestKind.REPLICA:
        # Replicas live on replicated GPUs: healthy and not split by MIG is all they need.
        usable = [g for g, ok in zip(state.gpus, allowed, strict=True) if ok and g.healthy and not g.mig_enabled]
        if not usable:
            return None, "no healthy GPU for replicas"
        return (), "replicas are counted by the kubelet"
    demand = request_demand(req, models)
    a = state.arrays
    cand = a.gpu_candidates(demand)[0].copy()
    for j, ok in enumerate(allowed):
        cand[j] &= ok
    if cand.sum() < demand.count:
        return None, _why_not(state, demand, allowed)
    # Score on a view where disallowed GPUs are hidden.
    view = a
    if not all(allowed):
        view = a.copy()
        for j, ok in enumerate(allowed):
            if not ok:
                view.gpu_ok[0, j] = False
    try:
        slots = choose_gpus(view, 0, demand, gpu_policy, ctx)
    except ValueError as exc:
        return None, str(exc)
    return grants_on(state, demand, slots, req.memory_ratio or 0), "fits"


def grants_on(state: NodeState, demand: Demand, slots: Iterable[int], memory_ratio: int = 0) -> tuple[DeviceGrant, ...]:
    """The annotation's grants for ``demand`` on GPU slots ``slots`` of ``state`` (as :func:`choose_gpus` numbers
    them; the same slots as the node's row in a cluster built from node states)."""
    grants = []
    need = state.arrays.gpu_memory_need(demand)[0]
    for j in slots:
        gpu = state.gpus[j]
        if demand.exclusive:
            grants.append(DeviceGrant(gpu.minor, gpu.uuid, 100, gpu.memory_bytes, 100))
        else:
            mem = int(need[j])
            ratio = memory_ratio if memory_ratio else _ratio(mem, gpu.memory_bytes)
            grants.append(DeviceGrant(gpu.minor, gpu.uuid, demand.milli // 10, mem, ratio))
    return tuple(grants)


def _fit_reusing(
    state: NodeState,
    c: ContainerRequest,
    pool: list[DeviceGrant],
    models: frozenset[str] | None,
    gpu_policy: str | Policy,
    ctx: ScoreContext,
) -> tuple[tuple[DeviceGrant, ...] | None, str]:
    """An app container of a pod whose init containers had devices of the same resource: the kubelet
    hands it those devices first (``devicesToReuse``), so its record must name them; the rest is
    chosen as usual among the other GPUs."""
    req = c.request
    assert req is not None
    take = pool[: req.count]
    grants: list[DeviceGrant] = []
    a = state.arrays
    for g in take:
        if g.mig_uuid is not None:
            grants.append(g)
            continue
        j = state._slot.get(g.uuid)
        if j is None:
            return None, f"GPU {g.uuid} of its init container is not on this node"
        gpu = state.gpus[j]
        if req.kind is RequestKind.WHOLE or req.exclusive:
            grant = DeviceGrant(gpu.minor, gpu.uuid, 100, gpu.memory_bytes, 100)
        else:
            mem = req.memory_on(gpu.memory_bytes)
            grant = DeviceGrant(gpu.minor, gpu.uuid, req.core, mem,
                                req.memory_ratio if req.memory_ratio else _ratio(mem, gpu.memory_bytes))
        if not a.gpu_ok[0, j] or a.core_free[0, j] < grant.core * 10 or a.gmem_free[0, j] < grant.memory_bytes:
            return None, (f"the kubelet gives it GPU {gpu.index} of its init container first, and "
                          f"{_pct(int(a.core_free[0, j]))} compute is free there, {grant.core} % asked")
        grants.append(grant)
    rest = req.count - len(take)
    if rest <= 0:
        return tuple(grants), "fits (init container's devices reused)"
    trial = state.copy()
    for g in take:
        if g.mig_uuid is not None:
            trial.mig_free.discard(g.mig_uuid)
        elif (j := trial._slot.get(g.uuid)) is not None:
            trial.arrays.gpu_ok[0, j] = False
    more, why = _fit_container(trial, replace(c, request=replace(req, count=rest)), models, gpu_policy, ctx)
    if more is None:
        return None, why
    return (*grants, *more), "fits"


def _ratio(mem: int, cap: int) -> int:
    if cap <= 0:
        return 0
    return max(1, min(100, -(-mem * 100 // cap)))


def _why_not(state: NodeState, demand: Demand, allowed: list[bool]) -> str:
    a = state.arrays
    need_mem = a.gpu_memory_need(demand)[0]
    parts = []
    for j, gpu in enumerate(state.gpus):
        if not allowed[j]:
            parts.append(f"GPU {gpu.index}: model {gpu.model} not allowed")
        elif not gpu.healthy:
            parts.append(f"GPU {gpu.index}: unhealthy")
        elif gpu.mig_enabled:
            parts.append(f"GPU {gpu.index}: MIG-enabled")
        else:
            core, mem = int(a.core_free[0, j]), int(a.gmem_free[0, j])
            if demand.exclusive:
                if core < MILLI or mem < a.gmem_cap[0, j]:
                    parts.append(f"GPU {gpu.index}: in use ({_pct(core)} compute free)")
            elif core < demand.milli:
                parts.append(f"GPU {gpu.index}: {_pct(core)} compute free, {_pct(demand.milli)} requested")
            elif mem < need_mem[j]:
                parts.append(f"GPU {gpu.index}: {_gib(mem)} memory free, {_gib(int(need_mem[j]))} requested")
    what = (
        f"{demand.count} whole GPU(s)"
        if demand.exclusive
        else f"{demand.count} GPU(s) with {_pct(demand.milli)} compute each"
    )
    detail = "; ".join(parts) if parts else "no GPUs"
    return f"needs {what}: {detail}"


def _fit_mig(state: NodeState, req: GpuRequest, allowed: list[bool]) -> tuple[tuple[DeviceGrant, ...] | None, str]:
    ok_parents = {g.uuid for g, ok in zip(state.gpus, allowed, strict=True) if ok}
    free = sorted(
        (
            state._mig[u]
            for u in state.mig_free
            if state._mig[u][1].profile == req.mig_profile and state._mig[u][0].uuid in ok_parents
        ),
        key=lambda gm: (gm[0].index, gm[1].index, gm[1].uuid),
    )
    if len(free) < req.count:
        return None, f"needs {req.count} MIG {req.mig_profile} device(s), {len(free)} free"
    grants = []
    for gpu, mig in free[: req.count]:
        m = _MIG_G.match(mig.profile)
        core = min(100, int(m.group(1)) * 100 // 7) if m else 0
        grants.append(
            DeviceGrant(
                gpu.minor,
                gpu.uuid,
                core,
                mig.memory_bytes,
                _ratio(mig.memory_bytes, gpu.memory_bytes),
                mig.uuid,
                mig.profile,
            )
        )
    return tuple(grants), "fits"
