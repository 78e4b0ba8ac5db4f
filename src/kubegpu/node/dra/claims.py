"""Offline checks of ResourceClaims and ResourceClaimTemplates that name kubegpu's DeviceClasses.

The API server accepts claims that can never be allocated (recorded: ``capacity.requests.compute:
150`` is stored, then the pod waits forever with ``cannot allocate all claims``). ``kubegpu check``
runs :func:`claim_problems` on every claim and template in a manifest, so such a request is refused
before it is applied. Requests naming other drivers' classes are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from kubegpu.model.quantity import QuantityError, format_bytes, parse

SUFFIX: Final = ".kubegpu.io"
WHOLE: Final = ("gpu.kubegpu.io", "gpu-extended.kubegpu.io", "mig.kubegpu.io")
SHARED: Final = "shared-gpu.kubegpu.io"
SHARE_CAPACITIES: Final = ("compute", "memory")


def _known(cls: str) -> bool:
    from kubegpu.install.dra import MIG_PROFILES

    return cls in (*WHOLE, SHARED) or any(cls == f"mig-{p}{SUFFIX}" for p in MIG_PROFILES)


def _request_problems(where: str, sub: Mapping[str, Any]) -> list[str]:
    cls = str(sub.get("deviceClassName", ""))
    if not cls.endswith(SUFFIX):
        return []
    if not _known(cls):
        return [f"{where}: DeviceClass {cls!r} is not one kubegpu installs (gpu.kubegpu.io, mig.kubegpu.io, "
                f"mig-<profile>.kubegpu.io, shared-gpu.kubegpu.io, gpu-extended.kubegpu.io)"]
    out: list[str] = []
    mode = sub.get("allocationMode", "ExactCount")
    if mode == "ExactCount":
        count = sub.get("count", 1)
        if not isinstance(count, int) or count < 1:
            out.append(f"{where}: count {count!r} must be a whole number of at least 1")
    requests = (sub.get("capacity") or {}).get("requests") or {}
    if requests and cls != SHARED:
        out.append(f"{where}: capacity.requests needs {SHARED} (whole GPUs and MIG devices are not shared); "
                   f"{cls} devices are given whole")
    if cls == SHARED:
        # A capacity a claim does not name defaults to all of it (the GPU takes whole claims too), so a
        # share names both, as a device-plugin share declares its memory (gpu-core alone is refused).
        missing = [c for c in SHARE_CAPACITIES if c not in requests]
        if len(missing) == 2:
            out.append(f"{where}: a {SHARED} claim needs capacity.requests compute and memory; without them it "
                       f"takes a whole GPU (use gpu.kubegpu.io for that)")
        elif missing:
            out.append(f"{where}: capacity.requests names no {missing[0]}, so the share would take all of the "
                       f"GPU's {missing[0]}; name both compute and memory")
    for name, value in requests.items():
        if cls != SHARED:
            break
        if name not in SHARE_CAPACITIES:
            out.append(f"{where}: capacity {name!r} is not offered by shared GPUs (only compute and memory)")
            continue
        try:
            q = parse(value)
        except (QuantityError, ValueError, TypeError):
            out.append(f"{where}: capacity.requests.{name} {value!r} is not a quantity")
            continue
        if name == "compute" and not (1 <= q <= 100 and q == q.to_integral_value()):
            out.append(f"{where}: capacity.requests.compute {value} must be a whole percent from 1 to 100 "
                       "(one GPU); the API server accepts it but the claim could never be allocated")
        if name == "memory" and q < 2**30:
            out.append(f"{where}: capacity.requests.memory {value} is below a share's minimum "
                       f"{format_bytes(2**30)} (it is rounded up to whole Gi)")
    if sub.get("selectors") and not all(((s or {}).get("cel") or {}).get("expression") for s in sub["selectors"]):
        out.append(f"{where}: a selector without cel.expression")
    return out


def claim_problems(obj: Mapping[str, Any]) -> list[str]:
    """Why a ResourceClaim or ResourceClaimTemplate using kubegpu's classes cannot be served (empty: fine)."""
    spec = obj.get("spec") or {}
    if obj.get("kind") == "ResourceClaimTemplate":
        spec = spec.get("spec") or {}
    out: list[str] = []
    for i, req in enumerate(((spec.get("devices") or {}).get("requests")) or []):
        name = (req or {}).get("name", str(i))
        if "exactly" in (req or {}):
            out += _request_problems(f"request {name}", req["exactly"])
        for j, sub in enumerate((req or {}).get("firstAvailable") or []):
            out += _request_problems(f"request {name}/{(sub or {}).get('name', j)}", sub)
    return out


def uses_kubegpu(obj: Mapping[str, Any]) -> bool:
    spec = obj.get("spec") or {}
    if obj.get("kind") == "ResourceClaimTemplate":
        spec = spec.get("spec") or {}
    for req in ((spec.get("devices") or {}).get("requests")) or []:
        subs = [req.get("exactly") or {}, *(req.get("firstAvailable") or [])]
        if any(str(s.get("deviceClassName", "")).endswith(SUFFIX) for s in subs):
            return True
    return False


def summary(obj: Mapping[str, Any]) -> str:
    """``gpu: 1 x gpu.kubegpu.io; share: 1 x shared-gpu.kubegpu.io (compute 30, memory 8Gi)``."""
    spec = obj.get("spec") or {}
    if obj.get("kind") == "ResourceClaimTemplate":
        spec = spec.get("spec") or {}
    parts = []
    for req in ((spec.get("devices") or {}).get("requests")) or []:
        for sub in [req.get("exactly")] if req.get("exactly") else list(req.get("firstAvailable") or []):
            n = "all" if sub.get("allocationMode") == "All" else str(sub.get("count", 1))
            caps = (sub.get("capacity") or {}).get("requests") or {}
            extra = f" ({', '.join(f'{k} {v}' for k, v in caps.items())})" if caps else ""
            parts.append(f"{req.get('name')}: {n} x {sub.get('deviceClassName')}{extra}")
    return "; ".join(parts)


def claim_objects(file: str, docs: list[Any]) -> list[dict[str, Any]]:
    """``kubegpu check`` objects for the claims and templates of a file that use kubegpu's classes."""
    out = []
    for i, d in enumerate(docs):
        if not isinstance(d, dict) or d.get("kind") not in ("ResourceClaim", "ResourceClaimTemplate"):
            continue
        if not uses_kubegpu(d):
            continue
        meta = d.get("metadata") or {}
        problems = claim_problems(d)
        out.append({"file": file, "document": i, "kind": d["kind"], "name": meta.get("name", ""),
                    "namespace": meta.get("namespace", ""), "path": "", "allowed": not problems, "gpu": True,
                    "containers": [], "dra": summary(d),
                    "refusals": [{"container": "", "resource": "resource.k8s.io/v1", "value": "", "rule": "dra",
                                  "code": "dra-claim", "message": p} for p in problems],
                    "patch": [], "warnings": [], "changes": [], "notes": []})
    return out
