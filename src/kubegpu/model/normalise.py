"""Admission of one pod: the verdict, the refusals and the JSON patch that makes it canonical.

The admission webhook and ``kubegpu check`` both call :func:`review_pod`, so the
offline check and the cluster give the same verdict and the same normalised
requests for the same pod. Pure: a pod dict in, a :class:`PodReview` out.

What it adds to the request parser (:func:`kubegpu.model.request.parse_pod`):

* the GPU visibility rules. The NVIDIA runtime gives a container the GPUs named
  in its ``NVIDIA_VISIBLE_DEVICES``; kubelet puts the pod's own environment
  after the device plugin's, so a container that sets the variable itself
  overrides the plugin and can see every GPU of the node. Unprivileged
  containers may not set it (nor the other variables the runtime honours for
  devices: IMEX channels, MIG config/monitor), may not mount into the runtime's
  volume-mount device list, and the pod may not carry CDI annotations. A
  variable that arrives through ``envFrom`` (a ConfigMap or Secret) is out of
  reach of admission: the API server does not resolve it. Privileged containers
  see every device node anyway, so the rules do not apply to them.
* ``NVIDIA_VISIBLE_DEVICES=void`` for containers that ask for no GPU, in pods
  that can land on a GPU node: GPU pods (sidecars, init containers) and pods that
  tolerate the GPU taint. Pods that do not tolerate it cannot run on tainted GPU
  nodes, so they pass with no patch (``void_all_pods`` for clusters whose GPU
  nodes are not tainted).
* the toleration for the GPU taint on GPU pods.
* the legacy ``scheduler.alpha.kubernetes.io/affinity`` annotation translated
  (:mod:`kubegpu.model.legacy`): its ``alpha.kubernetes.io/nvidia-gpu-name`` choice becomes the
  ``kubegpu.io/gpu-model`` constraint and, where the pod has none, ``spec.affinity``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubegpu.model import legacy
from kubegpu.model import resources as R
from kubegpu.model.annotations import GPU_MODEL
from kubegpu.model.names import review_names
from kubegpu.model.request import ContainerRequest, PodRequest, Refusal, parse_pod

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
# Variables the NVIDIA container runtime turns into device access for the container.
# CUDA_VISIBLE_DEVICES is not among them: CUDA applies it inside the devices already given.
DEVICE_ENV_VARS = frozenset({VISIBLE_DEVICES, "NVIDIA_IMEX_CHANNELS", "NVIDIA_MIG_CONFIG_DEVICES",
                             "NVIDIA_MIG_MONITOR_DEVICES"})
# Values that grant nothing, so any container may set them (and the webhook's own patch uses one).
HARMLESS_VISIBLE_VALUES = frozenset({"void", "none", ""})
VOLUME_MOUNT_DEVICE_ROOT = "/var/run/nvidia-container-devices"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
_CONTAINER_KEYS = (("initContainers", True), ("containers", False))


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """What the normalisation adds besides the canonical resources (flags of ``kubegpu webhook``)."""

    add_toleration: bool = True
    taint_key: str = R.NVIDIA_GPU
    void_env: bool = True
    void_all_pods: bool = False
    replica_resources: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class PodReview:
    request: PodRequest
    refusals: tuple[Refusal, ...]
    patch: tuple[dict[str, Any], ...] = ()
    warnings: tuple[str, ...] = ()
    gpu_pod: bool = False

    @property
    def allowed(self) -> bool:
        return not self.refusals


@dataclass(slots=True)
class _Builder:
    ops: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)


def _privileged(container: Mapping[str, Any]) -> bool:
    sc = container.get("securityContext")
    return isinstance(sc, Mapping) and sc.get("privileged") is True


def _env_list(container: Mapping[str, Any]) -> list[Any]:
    env = container.get("env")
    return env if isinstance(env, list) else []


def _sets_visible_devices(container: Mapping[str, Any]) -> bool:
    return any(isinstance(e, Mapping) and e.get("name") == VISIBLE_DEVICES for e in _env_list(container))


def _container_name(container: Mapping[str, Any], i: int) -> str:
    name = container.get("name")
    return name if isinstance(name, str) and name else f"#{i}"


def _visibility_refusals(name: str, container: Mapping[str, Any], out: list[Refusal]) -> None:
    for e in _env_list(container):
        if not isinstance(e, Mapping) or e.get("name") not in DEVICE_ENV_VARS:
            continue
        var = e["name"]
        value = e.get("value", "")
        if var == VISIBLE_DEVICES and "valueFrom" not in e and isinstance(value, str) \
                and value.strip().lower() in HARMLESS_VISIBLE_VALUES:
            continue
        shown = value if "valueFrom" not in e else "(valueFrom)"
        out.append(Refusal(name, f"env {var}", str(shown),
                           "an unprivileged container may not choose its own GPUs: the NVIDIA runtime "
                           "would give it these devices instead of the ones it was allocated; request "
                           "GPUs through resources", "visibility-env"))
    mounts = container.get("volumeMounts")
    for m in mounts if isinstance(mounts, list) else []:
        path = m.get("mountPath") if isinstance(m, Mapping) else None
        if isinstance(path, str) and path.rstrip("/").startswith(VOLUME_MOUNT_DEVICE_ROOT):
            out.append(Refusal(name, "volumeMounts", path,
                               f"an unprivileged container may not mount under {VOLUME_MOUNT_DEVICE_ROOT} "
                               "(the NVIDIA runtime reads device choices from there)", "visibility-mount"))


def _tolerates(tolerations: object, key: str) -> bool:
    for t in tolerations if isinstance(tolerations, list) else []:
        if not isinstance(t, Mapping):
            continue
        effect = t.get("effect") or ""
        if effect not in ("", "NoSchedule"):
            continue
        op = t.get("operator") or "Equal"
        t_key = t.get("key") or ""
        if (op == "Exists" and t_key in ("", key)) or (op == "Equal" and t_key == key):
            return True
    return False


def _touches_nvidia(container: Mapping[str, Any]) -> bool:
    """True when the container names any nvidia.com/ resource (maybe a renamed GPU kubegpu cannot tell)."""
    res = container.get("resources")
    if not isinstance(res, Mapping):
        return False
    for section in (res.get("limits"), res.get("requests")):
        if isinstance(section, Mapping) and any(isinstance(k, str) and k.startswith(R.NVIDIA_PREFIX)
                                                for k in section):
            return True
    return False


def _canonical_resources(container: Mapping[str, Any], cr: ContainerRequest,
                         replicas: frozenset[str]) -> dict[str, Any] | None:
    """The container's new ``resources`` (GPU entries canonical, in limits and requests), or None
    when it already is."""
    res = container.get("resources")
    res = res if isinstance(res, Mapping) else {}
    new: dict[str, Any] = dict(res)
    for section in ("limits", "requests"):
        old = res.get(section)
        old = old if isinstance(old, Mapping) else {}
        kept = {k: v for k, v in old.items() if not (isinstance(k, str) and R.is_gpu_resource(k, replicas))}
        new[section] = {**kept, **cr.limits}
    same = all(
        _same_entries(res.get(section), new[section]) for section in ("limits", "requests")
    )
    return None if same else new


def _same_entries(old: object, new: Mapping[str, Any]) -> bool:
    if not isinstance(old, Mapping) or len(old) != len(new):
        return False
    return all(k in old and str(old[k]) == str(v) for k, v in new.items())


def _describe_rewrite(cr: ContainerRequest) -> str:
    canon = ", ".join(f"{k}={v}" for k, v in cr.limits.items())
    renamed = f" (renamed: {', '.join(sorted(cr.renamed))})" if cr.renamed else ""
    return f"container {cr.name!r}: GPU resources set to {canon} in limits and requests{renamed}"


def _translate_legacy_affinity(annotations: Mapping[str, Any], spec: Mapping[str, Any], b: _Builder) -> None:
    key = legacy.LEGACY_AFFINITY
    try:
        t = legacy.translate(annotations[key])
    except legacy.LegacyAffinityError as exc:
        b.refusals.append(Refusal("-", f"annotation {key}", str(annotations[key])[:120],
                                  f"{exc}; write it as spec.affinity instead", "legacy-affinity"))
        return
    if t.models is not None and not t.models:
        b.refusals.append(Refusal("-", f"annotation {key}", str(annotations[key])[:120],
                                  "its alpha.kubernetes.io/nvidia-gpu-name expressions allow no GPU model",
                                  "legacy-affinity"))
        return
    if t.models:
        wanted = "|".join(sorted(t.models))
        if GPU_MODEL not in annotations:
            b.ops.append({"op": "add", "path": "/metadata/annotations/" + GPU_MODEL.replace("/", "~1"),
                          "value": wanted})
        elif annotations[GPU_MODEL] != wanted:
            b.warnings.append(f"{GPU_MODEL} is set ({annotations[GPU_MODEL]!r}); the legacy {key} "
                              f"({wanted!r}) is not applied to it")
    if "affinity" in spec:
        b.warnings.append(f"{t.note}; spec.affinity is set, so the annotation is not copied there")
    else:
        b.ops.append({"op": "add", "path": "/spec/affinity", "value": t.affinity})
        b.warnings.append(f"{t.note}: set as {GPU_MODEL} and spec.affinity")


def review_pod(pod: Mapping[str, Any], policy: AdmissionPolicy = AdmissionPolicy()) -> PodReview:
    """Validate and normalise one pod (a dict shaped like a v1.Pod). Never raises on bad input."""
    parsed = parse_pod(pod, replica_resources=policy.replica_resources)
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if not isinstance(spec, Mapping):
        return PodReview(parsed, parsed.refusals)
    b = _Builder(refusals=list(parsed.refusals))
    # Names no node serves, and GPU requests Kubernetes would never read (kubegpu.model.names).
    name_refusals, b.warnings = review_names(pod, policy.replica_resources)
    b.refusals += name_refusals
    by_name = {(c.init, c.name): c for c in parsed.containers}
    gpu_pod = parsed.wants_gpu
    can_reach_gpus = gpu_pod or policy.void_all_pods or _tolerates(spec.get("tolerations"), policy.taint_key)

    any_unprivileged = False
    for key, init in _CONTAINER_KEYS:
        items = spec.get(key)
        for i, c in enumerate(items if isinstance(items, list) else []):
            if not isinstance(c, Mapping):
                continue
            name = _container_name(c, i)
            privileged = _privileged(c)
            any_unprivileged |= not privileged
            if not privileged:
                _visibility_refusals(name, c, b.refusals)
            cr = by_name.get((init, name))
            if cr is not None and cr.request is not None:
                new = _canonical_resources(c, cr, policy.replica_resources)
                if new is not None:
                    b.ops.append({"op": "add", "path": f"/spec/{key}/{i}/resources", "value": new})
                    b.warnings.append(_describe_rewrite(cr))
            elif (policy.void_env and can_reach_gpus and not privileged and not _sets_visible_devices(c)
                  and not _touches_nvidia(c)):
                void = {"name": VISIBLE_DEVICES, "value": "void"}
                if isinstance(c.get("env"), list):
                    b.ops.append({"op": "add", "path": f"/spec/{key}/{i}/env/-", "value": void})
                else:
                    b.ops.append({"op": "add", "path": f"/spec/{key}/{i}/env", "value": [void]})

    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    if any_unprivileged and isinstance(annotations, Mapping):
        for k, v in annotations.items():
            if isinstance(k, str) and k.startswith(CDI_ANNOTATION_PREFIX):
                b.refusals.append(Refusal("-", f"annotation {k}", str(v),
                                          "CDI device annotations would give devices outside the "
                                          "allocation; request GPUs through resources", "cdi-annotation"))

    if isinstance(annotations, Mapping) and legacy.LEGACY_AFFINITY in annotations:
        _translate_legacy_affinity(annotations, spec, b)

    if gpu_pod and policy.add_toleration and not _tolerates(spec.get("tolerations"), policy.taint_key):
        tol = {"key": policy.taint_key, "operator": "Exists", "effect": "NoSchedule"}
        if isinstance(spec.get("tolerations"), list):
            b.ops.append({"op": "add", "path": "/spec/tolerations/-", "value": tol})
        else:
            b.ops.append({"op": "add", "path": "/spec/tolerations", "value": [tol]})

    refusals = tuple(b.refusals)
    if refusals:
        return PodReview(parsed, refusals, gpu_pod=gpu_pod)
    return PodReview(parsed, refusals, tuple(b.ops), tuple(b.warnings), gpu_pod)


def request_summary(parsed: PodRequest) -> list[dict[str, Any]]:
    """The normalised requests as plain data: what ``kubegpu check --json`` prints and what the
    webhook's patched pod parses back to (the two are compared in the tests)."""
    out: list[dict[str, Any]] = []
    for c in parsed.gpu_containers:
        req = c.request
        assert req is not None
        out.append({
            "container": c.name,
            "init": c.init,
            "kind": str(req.kind),
            "count": req.count,
            "resource": req.resource,
            "core_per_gpu": req.core,
            "memory_bytes_per_gpu": req.memory_bytes,
            "memory_ratio_per_gpu": req.memory_ratio,
            "mig_profile": req.mig_profile,
            "canonical": dict(c.limits),
        })
    return out


def review_ephemeral(pod: Mapping[str, Any], old_pod: Mapping[str, Any] | None,
                     policy: AdmissionPolicy = AdmissionPolicy()) -> PodReview:
    """Judge the ephemeral containers added by an update of ``pods/ephemeralcontainers``
    (``kubectl debug``): they cannot ask for GPUs, so they get the visibility rules and ``void``.
    Containers already in ``old_pod`` are immutable and left alone."""
    parsed = PodRequest((), ())
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if not isinstance(spec, Mapping):
        return PodReview(parsed, ())
    old_spec = old_pod.get("spec") if isinstance(old_pod, Mapping) else None
    old_items = old_spec.get("ephemeralContainers") if isinstance(old_spec, Mapping) else None
    existing = {c.get("name") for c in old_items if isinstance(c, Mapping)} if isinstance(old_items, list) \
        else set()
    b = _Builder()
    items = spec.get("ephemeralContainers")
    for i, c in enumerate(items if isinstance(items, list) else []):
        if not isinstance(c, Mapping) or c.get("name") in existing or _privileged(c):
            continue
        _visibility_refusals(_container_name(c, i), c, b.refusals)
        if policy.void_env and not _sets_visible_devices(c):
            void = {"name": VISIBLE_DEVICES, "value": "void"}
            if isinstance(c.get("env"), list):
                b.ops.append({"op": "add", "path": f"/spec/ephemeralContainers/{i}/env/-", "value": void})
            else:
                b.ops.append({"op": "add", "path": f"/spec/ephemeralContainers/{i}/env", "value": [void]})
    if b.refusals:
        return PodReview(parsed, tuple(b.refusals))
    return PodReview(parsed, (), tuple(b.ops))
