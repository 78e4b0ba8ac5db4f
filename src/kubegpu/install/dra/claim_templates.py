"""The ResourceClaimTemplates ``kubegpu manifests --dra`` renders from ``dra.claimTemplates`` in the values.

Without them every namespace that runs GPU pods on DRA writes its own template for the same few sizes (a
whole GPU, two, a 25 % / 20 Gi share) and gets the capacity rules wrong in its own way. The operator names
the sizes once; each becomes a template in every namespace listed, and a pod asks for one by name
(docs/dra.md, "Claim templates"). Each rendered template passes the same check the webhook and
``kubegpu check`` apply to hand-written ones (:func:`kubegpu.node.dra.claims.claim_problems`).
"""

from __future__ import annotations

import re
from typing import Any, Final

from kubegpu.install.values import ClaimTemplateValues, Values
from kubegpu.node.dra.claims import SHARED, WHOLE, claim_problems

Obj = dict[str, Any]
REQUEST: Final = "gpu"  # the request's name in every template: what a container's resources.claims names
# Kubernetes object names: a DNS subdomain (templates), a DNS label (namespaces).
_SUBDOMAIN: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _request(t: ClaimTemplateValues) -> Obj:
    if t.gpus is not None:
        return {"deviceClassName": WHOLE[0], "allocationMode": "ExactCount", "count": t.gpus}
    return {"deviceClassName": SHARED, "allocationMode": "ExactCount", "count": 1,
            "capacity": {"requests": {"compute": str(t.compute), "memory": str(t.memory)}}}


def claim_template(t: ClaimTemplateValues, namespace: str, labels: dict[str, str]) -> Obj:
    """One ``resource.k8s.io/v1`` ResourceClaimTemplate: ``t.gpus`` whole GPUs, or one share of
    ``t.compute`` percent and ``t.memory``, as the single request ``gpu``."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": t.name, "namespace": namespace, "labels": labels},
            "spec": {"spec": {"devices": {"requests": [{"name": REQUEST, "exactly": _request(t)}]}}}}


def claim_templates(v: Values, labels: dict[str, str]) -> list[Obj]:
    """Every template of ``dra.claimTemplates``, once per namespace it names."""
    return [claim_template(t, ns, labels) for t in v.dra.claim_templates for ns in t.namespaces]


def claim_template_problems(v: Values) -> list[str]:
    """What is wrong with ``dra.claimTemplates``, each naming its key and what to do."""
    out: list[str] = []
    seen: dict[tuple[str, str], int] = {}
    for i, t in enumerate(v.dra.claim_templates):
        key = f"dra.claimTemplates[{i}]"
        if len(t.name) > 253 or not _SUBDOMAIN.fullmatch(t.name):
            out.append(f"{key}.name: {t.name[:64]!r} is not an object name (lower-case letters, digits, '-' and "
                       "'.', 253 at most)")
        if not t.namespaces:
            out.append(f"{key}.namespaces: name at least one namespace to render the template in")
        for ns in t.namespaces:
            if len(ns) > 63 or not _LABEL.fullmatch(ns):
                out.append(f"{key}.namespaces: {ns[:64]!r} is not a namespace name (lower-case letters, digits "
                           "and '-', 63 at most)")
            elif (ns, t.name) in seen:
                out.append(f"{key}: {ns}/{t.name} is also dra.claimTemplates[{seen[ns, t.name]}]; give each "
                           "template of a namespace its own name")
            else:
                seen[ns, t.name] = i
        share = t.compute is not None or t.memory is not None
        if (t.gpus is None) == (not share):
            out.append(f"{key}: give gpus (whole GPUs) or compute and memory (one share of a GPU), not "
                       f"{'both' if share else 'neither'}")
        elif t.gpus is not None and t.gpus < 1:
            out.append(f"{key}.gpus: {t.gpus} must be at least 1")
        elif share and (t.compute is None or t.memory is None):
            out.append(f"{key}: a share names both compute (percent of one GPU) and memory (e.g. 20Gi); without "
                       f"{'memory' if t.memory is None else 'compute'} it would take all of the GPU's")
        else:
            out += [f"{key}: {p.removeprefix(f'request {REQUEST}: ')}"
                    for p in claim_problems(claim_template(t, "x", {}))]
    return out
