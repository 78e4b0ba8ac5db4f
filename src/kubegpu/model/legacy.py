"""The Kubernetes 1.5-1.7 way of choosing a GPU model, translated into today's.

Before ``spec.affinity`` existed, a pod chose nodes with the ``scheduler.alpha.kubernetes.io/affinity``
annotation (a JSON ``Affinity``), and the kubelet labelled GPU nodes ``alpha.kubernetes.io/nvidia-gpu-name``
with the GPU's name (``Tesla K80``). Current schedulers ignore the annotation, so such a pod would land on
any GPU. The webhook translates it (:func:`translate`): the allowed models become kubegpu's GPU-model
constraint (``kubegpu.io/gpu-model``, which the extender applies per GPU), and, where the pod has no
``spec.affinity``, the annotation becomes ``spec.affinity`` with the model names written as the label values
the node daemon publishes (:func:`label_value`, GFD's sanitising rule), so any scheduler honours it.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, Final

from kubegpu.model.annotations import LEGACY_GPU_NAME_LABEL

LEGACY_AFFINITY: Final = "scheduler.alpha.kubernetes.io/affinity"
_DROPPED_CHARS_RE: Final = re.compile(r"[^-A-Za-z0-9_. ]")
_MAX_BYTES: Final = 64 * 1024


class LegacyAffinityError(ValueError):
    """An annotation that cannot be translated; the message says why."""


def label_value(text: str) -> str:
    """GFD's sanitise(): drop characters outside ``[A-Za-z0-9-_. ]``, join words with ``-``; then cut to a
    valid label value (63 characters, alphanumeric at both ends). ``Tesla K80`` -> ``Tesla-K80``."""
    words = _DROPPED_CHARS_RE.sub("", text).split()
    value = "-".join(words)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


@dataclass(frozen=True, slots=True)
class Translation:
    models: frozenset[str] | None  # the allowed GPU models (None: the annotation does not constrain them)
    affinity: dict[str, Any]  # the annotation as spec.affinity, GPU names as label values
    note: str  # what was translated, in words


def _terms(affinity: dict[str, Any]) -> list[Any]:
    node = affinity.get("nodeAffinity")
    if not isinstance(node, dict):
        return []
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    if not isinstance(required, dict):
        return []
    terms = required.get("nodeSelectorTerms")
    if not isinstance(terms, list):
        raise LegacyAffinityError("nodeSelectorTerms must be a list")
    return terms


def translate(raw: object) -> Translation:
    """Translate the annotation's value; raises LegacyAffinityError when it is not a usable Affinity."""
    if not isinstance(raw, str) or len(raw) > _MAX_BYTES:
        raise LegacyAffinityError("must be a JSON object of at most 64 KiB")
    try:
        affinity = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise LegacyAffinityError(f"is not valid JSON ({str(exc)[:80]})") from None
    if not isinstance(affinity, dict) or not set(affinity) <= {"nodeAffinity", "podAffinity", "podAntiAffinity"}:
        raise LegacyAffinityError("must be an Affinity object (nodeAffinity, podAffinity, podAntiAffinity)")
    out = copy.deepcopy(affinity)
    # Terms are ORed, the expressions of one term ANDed: the allowed models are the union over the terms of
    # each term's allowed set; a term without a GPU-name expression allows every model.
    allowed: set[str] = set()
    unconstrained = False
    for t, term in enumerate(_terms(out)):
        if not isinstance(term, dict) or not isinstance(term.get("matchExpressions", []), list):
            raise LegacyAffinityError(f"nodeSelectorTerms[{t}] must be an object with a matchExpressions list")
        term_models: set[str] | None = None
        for e, expr in enumerate(term.get("matchExpressions", [])):
            if not isinstance(expr, dict) or expr.get("key") != LEGACY_GPU_NAME_LABEL:
                continue
            values = expr.get("values", [])
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise LegacyAffinityError(f"nodeSelectorTerms[{t}].matchExpressions[{e}].values must be strings")
            expr["values"] = [label_value(v) for v in values]
            if expr.get("operator") == "In":
                term_models = set(values) if term_models is None else term_models & set(values)
        if term_models is None:
            unconstrained = True
        else:
            allowed |= term_models
    models = None if unconstrained or not _terms(out) else frozenset(allowed)
    if models is None:
        note = f"legacy {LEGACY_AFFINITY} (no GPU-name In expression in every term) copied to spec.affinity"
    else:
        note = (f"legacy {LEGACY_AFFINITY} on {LEGACY_GPU_NAME_LABEL}: GPU models "
                f"{', '.join(sorted(models)) or '(none)'}")
    return Translation(models, out, note)
