"""Read-modify-write against the stand-in API server: a write carrying the resourceVersion it read fails
with 409 when someone wrote in between, and writers that read again and retry lose no write. The writers
here are what a controller would use; kubegpu's own writes are merge patches, Bindings and Events
(:mod:`kubegpu.kube.writes`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightkube import AsyncClient, Client
from lightkube.types import PatchType

from kubegpu.kube import Pod, make_async_client, make_client
from kubegpu.kube.writes import is_conflict

ATTEMPTS = 30


def _pause(attempt: int) -> float:
    return min(0.2, 0.005 * 2**attempt)


def update_with_retry(client: Client, res: type, name: str, mutate: Callable[[Any], Any], *,
                      namespace: str) -> Any:
    """Read, ``mutate`` into the object to write, replace it with the version read; on 409 read again and
    retry."""
    for attempt in range(ATTEMPTS):
        new = mutate(client.get(res, name, namespace=namespace))
        try:
            return client.replace(new)
        except Exception as e:
            if not is_conflict(e):
                raise
            time.sleep(_pause(attempt))
    raise AssertionError(f"{name}: still conflicting after {ATTEMPTS} attempts")


async def aupdate_with_retry(client: AsyncClient, res: type, name: str, mutate: Callable[[Any], Any], *,
                             namespace: str) -> Any:
    for attempt in range(ATTEMPTS):
        new = mutate(await client.get(res, name, namespace=namespace))
        try:
            return await client.replace(new)
        except Exception as e:
            if not is_conflict(e):
                raise
            await asyncio.sleep(_pause(attempt))
    raise AssertionError(f"{name}: still conflicting after {ATTEMPTS} attempts")


async def apatch_with_precondition(client: AsyncClient, res: type, name: str,
                                   build: Callable[[Any], dict[str, Any] | None], *, namespace: str) -> Any:
    """Read, ``build`` a merge patch (None: nothing to do), send it with the read resourceVersion as a
    precondition; on 409 read again and retry."""
    for attempt in range(ATTEMPTS):
        obj: Any = await client.get(res, name, namespace=namespace)
        patch = build(obj)
        if patch is None:
            return obj
        patch.setdefault("metadata", {})["resourceVersion"] = obj.metadata.resourceVersion
        try:
            return await client.patch(res, name, patch, namespace=namespace, patch_type=PatchType.MERGE)
        except Exception as e:
            if not is_conflict(e):
                raise
            await asyncio.sleep(_pause(attempt))
    raise AssertionError(f"{name}: still conflicting after {ATTEMPTS} attempts")


def _pod(name: str) -> dict:
    return {"metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": [{"name": "c", "image": "x"}]}}


def test_a_replace_after_another_write_conflicts_and_the_retry_keeps_both(kubeconfig: Path) -> None:
    c = make_client(kubeconfig)
    c.create(Pod.from_dict(_pod("p")))
    interfered = {"n": 0}

    def add_label(pod: Any) -> Any:
        # Another writer sneaks in after our read, the first two times: our replace must get 409 and retry.
        if interfered["n"] < 2:
            interfered["n"] += 1
            c.patch(Pod, "p", {"metadata": {"labels": {f"other{interfered['n']}": "x"}}}, namespace="default")
        pod.metadata.labels = {**(pod.metadata.labels or {}), "mine": "yes"}
        return pod

    out = update_with_retry(c, Pod, "p", add_label, namespace="default")
    assert out.metadata.labels == {"other1": "x", "other2": "x", "mine": "yes"}


def test_concurrent_read_modify_writes_lose_no_write(kubeconfig: Path) -> None:
    make_client(kubeconfig).create(Pod.from_dict(_pod("p")))

    async def many() -> dict:
        ac = make_async_client(kubeconfig)

        def bump(i: int) -> Callable[[Any], Any]:
            def mutate(pod: Any) -> Any:
                pod.metadata.annotations = {**(pod.metadata.annotations or {}), f"k{i}": str(i)}
                return pod
            return mutate

        await asyncio.gather(*(aupdate_with_retry(ac, Pod, "p", bump(i), namespace="default") for i in range(6)))
        return (await ac.get(Pod, "p", namespace="default")).metadata.annotations

    assert asyncio.run(many()) == {f"k{i}": str(i) for i in range(6)}


def test_a_merge_patch_with_a_stale_version_conflicts_and_is_built_again(kubeconfig: Path) -> None:
    c = make_client(kubeconfig)
    c.create(Pod.from_dict(_pod("p")))

    async def patched() -> tuple[list[str], dict]:
        ac = make_async_client(kubeconfig)
        seen: list[str] = []

        def build(pod: Any) -> dict[str, Any] | None:
            seen.append(pod.metadata.resourceVersion)
            if len(seen) == 1:  # someone else writes between our read and our patch: 409, read again
                c.patch(Pod, "p", {"metadata": {"labels": {"late": "1"}}}, namespace="default")
            if (pod.metadata.annotations or {}).get("mine") == "1":
                return None
            return {"metadata": {"annotations": {"mine": "1"}}}

        await apatch_with_precondition(ac, Pod, "p", build, namespace="default")
        return seen, (await ac.get(Pod, "p", namespace="default")).metadata.to_dict()

    seen, meta = asyncio.run(patched())
    assert len(seen) == 2 and seen[0] != seen[1]
    assert meta["annotations"]["mine"] == "1" and meta["labels"]["late"] == "1"
