"""Pod specs inside Kubernetes manifests: Pods, workload templates, CronJobs, Lists, multi-doc YAML.

``kubegpu check`` validates what people are about to apply, which is mostly
Deployments and Jobs rather than Pods; this module finds every pod template in
them and presents each as a Pod-shaped dict for the request parser. Pure: text
or parsed objects in, values out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kubegpu.model import yaml_text
from kubegpu.model.yaml_text import LOADER as _Loader  # noqa: F401 (the loader this module parses with)
from kubegpu.model.yaml_text import MAX_YAML_DEPTH  # noqa: F401 (the nesting limit it keeps to)

# kind -> path of the pod template inside the object.
TEMPLATE_PATHS: dict[str, tuple[str, ...]] = {
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "ReplicationController": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
    "PodTemplate": ("template",),
}
_MAX_DEPTH = 8  # generic search for templates in custom resources (training operators, rollouts)


class ManifestError(ValueError):
    """Text that is not YAML (or JSON), with the position of the problem."""


@dataclass(frozen=True, slots=True)
class PodSource:
    """One pod template found in a manifest, as a Pod-shaped dict."""

    document: int  # 0-based index of the YAML document
    kind: str
    name: str
    namespace: str
    path: str  # where the pod spec sits in the object ("" for a Pod)
    pod: Mapping[str, Any]

    @property
    def label(self) -> str:
        where = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return f"{self.kind} {where}" + (f" ({self.path})" if self.path else "")


@dataclass(frozen=True, slots=True)
class Skipped:
    """A document with no pod spec in it (a Service, a ConfigMap, ...)."""

    document: int
    kind: str
    name: str


def load_documents(text: str) -> list[Any]:
    """Every document of a (multi-document) YAML or JSON text; empty documents dropped."""
    try:
        return [d for d in yaml_text.load_all(text) if d is not None]
    except yaml_text.TooDeep as exc:
        raise ManifestError(f"not valid YAML: {exc}") from None
    except RecursionError:
        raise ManifestError("not valid YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ManifestError(f"not valid YAML{where}: {problem}") from None


def _meta(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        return "", ""
    name, ns = meta.get("name") or meta.get("generateName") or "", meta.get("namespace") or ""
    return (name if isinstance(name, str) else ""), (ns if isinstance(ns, str) else "")


def _dig(obj: object, path: tuple[str, ...]) -> object:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _as_pod(template: Mapping[str, Any], namespace: str) -> dict[str, Any]:
    meta = dict(template.get("metadata") or {}) if isinstance(template.get("metadata"), Mapping) else {}
    if namespace and "namespace" not in meta:
        meta["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template.get("spec")}


def _is_template(obj: object) -> bool:
    return isinstance(obj, Mapping) and isinstance(obj.get("spec"), Mapping) and "containers" in obj["spec"]


def _find_templates(obj: object, path: tuple[str, ...],
                    depth: int) -> Iterator[tuple[str, Mapping[str, Any]]]:
    if depth > _MAX_DEPTH:
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if k == "template" and _is_template(v):
                yield ".".join((*path, str(k))), v
            else:
                yield from _find_templates(v, (*path, str(k)), depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _find_templates(v, (*path[:-1], f"{path[-1]}[{i}]" if path else f"[{i}]"), depth + 1)


def pods_in(obj: object, document: int = 0) -> tuple[list[PodSource], list[Skipped]]:
    """Every pod spec in one parsed document (recursing into ``List`` items)."""
    if not isinstance(obj, Mapping):
        return [], [Skipped(document, type(obj).__name__, "")]
    raw_kind = obj.get("kind")
    kind = raw_kind if isinstance(raw_kind, str) else ""
    name, ns = _meta(obj)
    if kind.endswith("List") and isinstance(obj.get("items"), list):
        found: list[PodSource] = []
        skipped: list[Skipped] = []
        for item in obj["items"]:
            f, s = pods_in(item, document)
            found += f
            skipped += s
        return found, skipped
    if kind == "Pod":
        return [PodSource(document, kind, name, ns, "", obj)], []
    if kind in TEMPLATE_PATHS:
        template = _dig(obj, TEMPLATE_PATHS[kind])
        if isinstance(template, Mapping):
            path = ".".join(TEMPLATE_PATHS[kind])
            return [PodSource(document, kind, name, ns, path, _as_pod(template, ns))], []
        return [], [Skipped(document, kind, name)]
    found = [PodSource(document, kind or "?", name, ns, path, _as_pod(t, ns))
             for path, t in _find_templates(obj, (), 0)]
    return (found, []) if found else ([], [Skipped(document, kind or "?", name)])


def pods_in_text(text: str) -> tuple[list[PodSource], list[Skipped]]:
    """Every pod spec in a YAML/JSON text. Raises :class:`ManifestError` when it is not YAML."""
    found: list[PodSource] = []
    skipped: list[Skipped] = []
    for i, doc in enumerate(load_documents(text)):
        f, s = pods_in(doc, i)
        found += f
        skipped += s
    return found, skipped
