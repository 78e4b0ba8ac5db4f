"""Test topologies built by hand: the DGX-1 V100 hybrid cube-mesh and small helper nodes."""

from __future__ import annotations

from kubegpu.model import Gpu, MigDevice, NodeInventory

GIB = 2**30

# NVLink link counts of the DGX-1 V100 (nvidia-smi topo -m): GPUs 0-3 and 4-7 are fully connected
# quads (1- and 2-link pairs), plus the cross links 0-4, 1-5, 2-6, 3-7. Every GPU has 6 links.
DGX1_LINKS: dict[tuple[int, int], int] = {
    (0, 1): 1,
    (0, 2): 1,
    (0, 3): 2,
    (1, 2): 2,
    (1, 3): 1,
    (2, 3): 2,
    (4, 5): 1,
    (4, 6): 1,
    (4, 7): 2,
    (5, 6): 2,
    (5, 7): 1,
    (6, 7): 2,
    (0, 4): 2,
    (1, 5): 2,
    (2, 6): 1,
    (3, 7): 1,
}


def dgx1_gpus(model: str = "V100M16", healthy: set[int] | None = None) -> list[Gpu]:
    links: dict[int, dict[str, int]] = {i: {} for i in range(8)}
    for (a, b), n in DGX1_LINKS.items():
        links[a][f"GPU-{b}"] = n
        links[b][f"GPU-{a}"] = n
    return [
        Gpu(
            f"GPU-{i}",
            i,
            i,
            model,
            16 * GIB,
            healthy=healthy is None or i in healthy,
            numa_node=i // 4,
            links=links[i],
        )
        for i in range(8)
    ]


def dgx1(name: str = "dgx", **kw: object) -> NodeInventory:
    return NodeInventory(name, tuple(dgx1_gpus(**kw)), cpu_milli=80_000, memory_bytes=512 * GIB)  # type: ignore[arg-type]


def simple_node(
    name: str,
    n: int,
    model: str = "T4",
    memory: int = 16 * GIB,
    cpu: int = 32_000,
    unhealthy: set[int] = frozenset(),
) -> NodeInventory:  # type: ignore[assignment]
    gpus = tuple(Gpu(f"{name}-GPU-{i}", i, i, model, memory, healthy=i not in unhealthy, numa_node=0) for i in range(n))
    return NodeInventory(name, gpus, cpu_milli=cpu, memory_bytes=256 * GIB)


def mig_node(name: str = "a100") -> NodeInventory:
    parent = "GPU-A100-0"
    migs = tuple(MigDevice(f"MIG-{i}", "1g.10gb", parent, gi=i, ci=0, memory_bytes=10 * GIB, index=i) for i in range(7))
    gpus = (
        Gpu(parent, 0, 0, "A100", 80 * GIB, mig_enabled=True, mig_devices=migs),
        Gpu("GPU-A100-1", 1, 1, "A100", 80 * GIB),
    )
    return NodeInventory(name, gpus, cpu_milli=64_000, memory_bytes=512 * GIB)


def pod(*containers: dict[str, str], init: tuple[dict[str, str], ...] = (), model: str | None = None) -> dict:
    spec: dict = {"containers": [{"name": f"c{i}", "resources": {"limits": dict(c)}} for i, c in enumerate(containers)]}
    if init:
        spec["initContainers"] = [{"name": f"init{i}", "resources": {"limits": dict(c)}} for i, c in enumerate(init)]
    meta: dict = {"name": "p"}
    if model:
        meta["annotations"] = {"kubegpu.io/gpu-model": model}
    return {"metadata": meta, "spec": spec}
