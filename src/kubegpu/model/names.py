"""GPU resource names no node can offer, and GPU requests written where Kubernetes never reads them.

The request parser (:mod:`kubegpu.model.request`) takes any ``nvidia.com/`` name with ``gpu`` in it for a
renamed replica resource and any well-formed MIG name for a MIG device, because renames and new GPUs exist.
That made ``nvidia.com/gpus: 1`` or ``nvidia.com/mig-1g.11gb: 1`` an accepted request for a resource no node
serves: the pod then waits forever. Likewise ``resource:`` where ``resources:`` was meant hides the request
from Kubernetes altogether, so the pod runs without a GPU. This module is the one rule for both; the
admission review (:func:`kubegpu.model.normalise.review_pod`, used by the webhook and ``kubegpu check``) calls
it, and the parser's own "unknown resource name" refusal takes its suggestions from here.

A name is refused when no install serves it and it is a near miss of one that is served (a misspelling, with
the suggestion), or when it is a MIG profile of no GPU kubegpu knows; a ``nvidia.com/`` GPU name that is no
near miss is probably an operator's rename and gets a warning that says how to declare it.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable, Mapping
from typing import Any, Final

from kubegpu.model import resources as R
from kubegpu.model.request import Refusal

# How alike two names must be for one to be taken as a misspelling of the other (difflib's ratio):
# nvidia.com/gpus vs nvidia.com/gpu is 0.97; nvidia.com/gpu-small (a plausible rename) vs nvidia.com/gpu 0.82.
NEAR_MISS: Final = 0.85
# The keys a container's resources may hold (v1.ResourceRequirements).
_RESOURCE_KEYS: Final = frozenset({"limits", "requests", "claims"})
_CONTAINER_KEYS: Final = (("initContainers", True), ("containers", False))


def served_names(declared: Iterable[str] = ()) -> frozenset[str]:
    """Every resource name a kubegpu install can serve: canonical names, aliases, every MIG profile of the
    table (and its time-sliced ``.shared`` form) and the names the deployment declared (renames, extra MIG
    profiles)."""
    return _served(frozenset(declared))


@functools.lru_cache(maxsize=16)
def _served(declared: frozenset[str]) -> frozenset[str]:
    mig = R.mig_resources()
    return frozenset({*R.CANONICAL, *R.ALIASES, *mig, *(m + ".shared" for m in mig), *declared})


def _mig_shape(name: str) -> tuple[tuple[str | None, str, str], int] | None:
    """``nvidia.com/mig-1g.10gb.me`` -> ((None, "1", "gb.me"), 10): the profile without its memory size."""
    if not name.startswith(R.NVIDIA_MIG_PREFIX):
        return None
    m = R.MIG_PROFILE_RE.match(R.mig_profile(name).removesuffix(".shared"))
    if m is None:
        return None
    return (m.group(1), m.group(2), R.mig_profile(name)[m.end(3):]), int(m.group(3))


def _nearest_mig(name: str, served: frozenset[str]) -> str | None:
    """For an unknown MIG name, the served profile with the same slices and suffix and the nearest memory
    size (mig-1g.11gb -> mig-1g.10gb), where text similarity would pick any one-digit neighbour."""
    shape = _mig_shape(name)
    if shape is None:
        return None
    found = [(abs(s[1] - shape[1]), n) for n in served if (s := _mig_shape(n)) is not None and s[0] == shape[0]]
    return min(found)[1] if found else None


def suggest(name: str, declared: Iterable[str] = ()) -> str | None:
    """The served name ``name`` is most likely a misspelling of, or None when none is close."""
    if hit := _nearest_mig(name, served_names(declared)):
        return hit
    candidates = sorted(served_names(declared) - {name})
    # Lower case first: NVIDIA.com/GPU is a misspelling too, and difflib is case sensitive.
    lowered = {c.lower(): c for c in candidates}
    hits = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=NEAR_MISS)
    return lowered[hits[0]] if hits else None


def did_you_mean(name: str, declared: Iterable[str] = ()) -> str:
    """``"; did you mean 'nvidia.com/gpu'?"`` or ``""``: the tail of a refusal about ``name``."""
    hit = suggest(name, declared)
    return f"; did you mean {hit!r}?" if hit else ""


def _is_gpu_name(name: object, declared: frozenset[str]) -> bool:
    return isinstance(name, str) and R.is_gpu_resource(name, declared)


def _gpu_names_in(value: object, declared: frozenset[str]) -> list[str]:
    """The GPU resource names in a map or in its ``limits``/``requests`` maps (one level down)."""
    if not isinstance(value, Mapping):
        return []
    out = [k for k in value if _is_gpu_name(k, declared)]
    for section in ("limits", "requests"):
        inner = value.get(section)
        if isinstance(inner, Mapping):
            out += [k for k in inner if _is_gpu_name(k, declared)]
    return sorted(set(out))


def _unreadable(name: str, container: Mapping[str, Any], declared: frozenset[str]) -> list[Refusal]:
    """GPU names written where Kubernetes does not read a request: a misspelt ``resources`` key, or a
    misspelt (or missing) ``limits``/``requests`` level inside it."""
    out: list[Refusal] = []
    for key, value in container.items():
        if key == "resources" or not isinstance(key, str):
            continue
        found = _gpu_names_in(value, declared)
        if not found:
            continue
        if key in _RESOURCE_KEYS:
            fix = f"write resources.{key}"
        elif difflib.SequenceMatcher(None, key.lower(), "resources").ratio() >= 0.6:
            fix = "did you mean 'resources'?"
        else:
            fix = "put GPU resources under resources.limits"
        out.append(Refusal(name, key, ", ".join(found),
                           f"the GPU request cannot be read: {key!r} is not a container field, so Kubernetes "
                           f"ignores it and the container would get no GPU; {fix}", "unreadable-request"))
    res = container.get("resources")
    if isinstance(res, Mapping):
        for key, value in res.items():
            if key in _RESOURCE_KEYS or not isinstance(key, str):
                continue
            if _is_gpu_name(key, declared):
                out.append(Refusal(name, f"resources.{key}", str(value),
                                   "the GPU request cannot be read: resources hold limits and requests, "
                                   f"not resource names; write resources.limits.{key}", "unreadable-request"))
            elif found := _gpu_names_in(value, declared):
                close = difflib.get_close_matches(key.lower(), sorted(_RESOURCE_KEYS), n=1, cutoff=0.6)
                meant = f"; did you mean {close[0]!r}?" if close else "; write them under resources.limits"
                out.append(Refusal(name, f"resources.{key}", ", ".join(found),
                                   f"the GPU request cannot be read: {key!r} is not a field of resources"
                                   + meant, "unreadable-request"))
    return out


def _name_findings(name: str, resources: object, declared: frozenset[str],
                   refusals: list[Refusal], warnings: list[str]) -> None:
    if not isinstance(resources, Mapping):
        return
    served = served_names(declared)
    seen: set[str] = set()
    for section in ("limits", "requests"):
        entries = resources.get(section)
        if not isinstance(entries, Mapping):
            continue
        for key, value in entries.items():
            if not isinstance(key, str) or key in seen or key in served or not R.is_gpu_resource(key, declared):
                continue
            seen.add(key)
            if not R.is_known_name(key, declared):
                continue  # kubegpu.io/ and alias-domain typos: the parser refuses them (with did_you_mean)
            hint = did_you_mean(key, declared)
            if R.is_mig_resource(key) or R.is_shared_mig_resource(key):
                profile = R.mig_profile(key).removesuffix(".shared")
                refusals.append(Refusal(name, key, str(value),
                                        f"no GPU kubegpu knows has the MIG profile {profile!r}{hint} (a GPU newer "
                                        "than kubegpu's table: add the profile to the values' migProfiles)",
                                        "unknown-mig-profile"))
            elif hint:
                refusals.append(Refusal(name, key, str(value),
                                        f"no node serves this resource{hint}", "unknown-resource"))
            else:
                warnings.append(f"container {name!r}: {key} is not a resource kubegpu serves by default; if it "
                                "is a renamed GPU resource, declare it (the values' config.map or gpuResources, "
                                "or `kubegpu check --replica-resource`), otherwise no node will run this pod")


def review_names(pod: Mapping[str, Any], declared: Iterable[str] = ()) -> tuple[list[Refusal], list[str]]:
    """Refusals and warnings for the GPU resource names of a pod (a dict shaped like a v1.Pod).

    ``declared`` are the names the deployment serves beyond the defaults (renames, extra MIG profiles).
    Never raises on bad input; shapes the parser refuses are left to it.
    """
    refusals: list[Refusal] = []
    warnings: list[str] = []
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if not isinstance(spec, Mapping):
        return refusals, warnings
    known = frozenset(declared)
    for key, _init in _CONTAINER_KEYS:
        items = spec.get(key)
        for i, c in enumerate(items if isinstance(items, list) else []):
            if not isinstance(c, Mapping):
                continue
            raw = c.get("name")
            name = raw if isinstance(raw, str) and raw else f"#{i}"
            refusals += _unreadable(name, c, known)
            _name_findings(name, c.get("resources"), known, refusals, warnings)
    return refusals, warnings
