"""NVIDIA's device-plugin chart values, read the way an operator switching to kubegpu means them.

A values file written for ``nvidia-device-plugin`` (its defaults and the common overrides, chart 0.14 to the
current one) must render in one run. kubegpu's own values (``values.py``) carry every chart key kubegpu
honours under the chart's name; this module is the one place that says what happens to the others:

- keys that configure something kubegpu does not deploy (GPU feature discovery's and node-feature-discovery's
  DaemonSets), or that ask for what kubegpu does anyway, are accepted with any value (*inert*);
- keys kubegpu accepts at NVIDIA's default only, and refuses otherwise with what to do;
- whose image an ``image:`` block names: NVIDIA's image never becomes kubegpu's unless the operator says so.

It also walks a values mapping against kubegpu's schema, so every unknown key is reported in one pass, and
drops ``null`` values as Helm does (a ``null`` means "the chart's default").
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

KUBEGPU_REPOSITORY: Final = "ghcr.io/kubegpu/kubegpu"
NVIDIA_REPOSITORY: Final = "nvcr.io/nvidia/k8s-device-plugin"


@dataclass(frozen=True, slots=True)
class Rule:
    """A key of NVIDIA's chart that kubegpu's values do not have."""

    accepts: Callable[[Any], bool]  # the values kubegpu can take (they change nothing kubegpu would do)
    why: str  # for the other values: why kubegpu cannot honour them, and what to do


def _any(_: Any) -> bool:
    return True


def _falsy(v: Any) -> bool:
    return not v


_INERT = Rule(_any, "")
_NO_GFD = ("kubegpu renders no gpu-feature-discovery DaemonSet: `kubegpu node` publishes GFD's labels itself "
           "(the extender and nodeSelectors rely on them)")

# Dotted paths of NVIDIA chart keys that kubegpu's schema lacks. A path ending in ".*" covers every key below.
RULES: Final[dict[str, Rule]] = {
    "legacyDaemonsetAPI": Rule(_falsy, "it selects the extensions/v1beta1 DaemonSet API, gone since Kubernetes "
                                       "1.16; kubegpu renders apps/v1: remove it"),
    # kubegpu's selectors always carry app.kubernetes.io/component, and its DaemonSet is a new object (no
    # immutable selector of an earlier release to stay compatible with).
    "componentSelectorLabels.*": _INERT,
    "gfd.nameOverride": _INERT,
    "gfd.namespaceOverride": _INERT,
    "gfd.securityContext": _INERT,
    "gfd.enableHostNetwork": _INERT,
    "gfd.noTimestamp": _INERT,  # kubegpu never writes the timestamp label
    "gfd.sleepInterval": Rule(lambda v: v in (None, "60s", "1m", 60),
                              f"{_NO_GFD}, whenever what they say changes, not at an interval: remove it"),
    # The node-feature-discovery subchart's own values: kubegpu never deploys NFD (nfd.enabled: true is
    # refused in values.py with what to do).
    "nfd.*": _INERT,
    "mps.root": Rule(lambda v: v in (None, "/run/nvidia/mps"),
                     "kubegpu's node daemon keeps MPS pipes and logs under /run/nvidia/mps on the host: remove it"),
    "mps.enableHostPID": _INERT,
    "mps.enableHostNetwork": _INERT,
}


@dataclass(slots=True)
class Prepared:
    """A values mapping ready for ``msgspec.convert``, with what the operator must be told."""

    raw: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def prepare(raw: dict[str, Any], schema: type[msgspec.Struct]) -> Prepared:
    """Classify the image block, apply :data:`RULES`, drop nulls and find every unknown key of ``raw``."""
    out = Prepared(raw={})
    raw = dict(raw)
    _image_block(raw, out)
    out.raw = _walk(raw, schema, "", out)
    return out


def _image_block(raw: dict[str, Any], out: Prepared) -> None:
    """Keep ``image`` only where it names a kubegpu image; NVIDIA's is dropped with a note, any other refused.

    NVIDIA's chart defaults ``image`` to its own plugin (``tag: ""`` meaning the chart's version); a values file
    brought over keeps that block, and kubegpu's command in NVIDIA's image would never start. ``kubegpuImage``
    says which image kubegpu's pods run without doubt."""
    block = raw.get("image")
    if not isinstance(block, dict):
        return  # absent, null, or a type error msgspec reports
    repo = block.get("repository")
    if repo is not None and not isinstance(repo, str):
        return  # a type error msgspec reports
    explicit = raw.get("kubegpuImage") is not None
    if isinstance(repo, str) and is_kubegpu_repository(repo):
        return
    if isinstance(repo, str) and repo and not is_nvidia_repository(repo) and not explicit:
        out.problems.append(
            f"image.repository: {repo!r} is neither kubegpu's image ({KUBEGPU_REPOSITORY}, or a mirror whose "
            f"last path element is kubegpu) nor NVIDIA's device plugin: for kubegpu's pods set "
            f"kubegpuImage.repository (and kubegpuImage.tag), and remove image")
        del raw["image"]
        return
    del raw["image"]
    if any(v not in (None, "") for v in block.values()):
        shown = ", ".join(f"{k}: {v!r}" for k, v in block.items() if v not in (None, ""))
        out.notes.append(f"image ({shown}) is not kubegpu's image and is not used: kubegpu's pods run kubegpu's "
                         "image (kubegpuImage: repository, tag, pullPolicy chooses it)")


def show(value: Any) -> str:
    """A value as the operator wrote it in YAML (true, not Python's True)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value)


def field_type(schema: type[msgspec.Struct], path: str) -> Any:
    """The declared type at a dotted values path (``webhook.failurePolicy``), or None where there is none."""
    tp: Any = schema
    for part in path.split("."):
        struct = _struct_of(tp)
        if struct is None:
            return None
        fields = {f.encode_name: f.type for f in msgspec.structs.fields(struct)}
        if part not in fields:
            return None
        tp = fields[part]
    return tp


def _last_element(repo: str) -> str:
    return repo.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]


def is_kubegpu_repository(repo: str) -> bool:
    return _last_element(repo) == "kubegpu"


def is_nvidia_repository(repo: str) -> bool:
    return repo.startswith("nvcr.io/") or _last_element(repo) == "k8s-device-plugin"


def _struct_of(tp: Any) -> type[msgspec.Struct] | None:
    """The Struct type a field holds (also through ``X | None``), else None."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if isinstance(arg, type) and issubclass(arg, msgspec.Struct):
                return arg
    return None


def _rule(path: str) -> Rule | None:
    if path in RULES:
        return RULES[path]
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        rule = RULES.get(".".join(parts[:i]) + ".*")
        if rule is not None:
            return rule
    return RULES.get(path + ".*")


def _walk(raw: dict[str, Any], schema: type[msgspec.Struct] | None, prefix: str, out: Prepared) -> dict[str, Any]:
    """``raw`` less what :data:`RULES` took and nulls; every unknown key and refused value into ``out``. A
    section of NVIDIA's chart that kubegpu's schema lacks (``schema`` None) is walked for its rules only."""
    fields = {f.encode_name: f for f in msgspec.structs.fields(schema)} if schema else {}
    kept: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if not isinstance(key, str):
            out.problems.append(f"{path}: a values key must be a string")
            continue
        if key in fields:
            if value is None:
                continue  # Helm's meaning: the chart's default
            sub = _struct_of(fields[key].type)
            kept[key] = _walk(value, sub, f"{path}.", out) if sub and isinstance(value, dict) else value
            continue
        rule = _rule(path)
        if rule is None and isinstance(value, dict) and any(p.startswith(f"{path}.") for p in RULES):
            _walk(value, None, f"{path}.", out)
            continue
        if rule is not None:
            if not rule.accepts(value):
                out.problems.append(f"{path}: {show(value)} cannot be honoured: {rule.why}")
            continue
        if not prefix and key == "nvidia-device-plugin" and isinstance(value, dict):
            out.problems.append(f"{path}: NVIDIA's chart values as a subchart's section: give what is under "
                                f"{key} as the values file (kubegpu reads them at the top level)")
            continue
        known = list(fields) + [p[len(prefix):].split(".", 1)[0] for p in RULES if p.startswith(prefix)]
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
        out.problems.append(f"{path}: unknown key{hint}: neither a kubegpu setting nor a key of NVIDIA's chart "
                            "that kubegpu knows (docs/install.md lists them); remove it")
    return kept
