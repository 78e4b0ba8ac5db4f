"""The scheduler's install (``kubegpu manifests``, from ``kubegpu/install/base/scheduler``): valid Kubernetes
objects, an extender entry that covers every GPU resource, and RBAC that
grants exactly what the extender calls."""

from __future__ import annotations

import kubernetes_validate

from kubegpu.install.render import scheduler_config, scheduler_objects
from kubegpu.install.values import Values
from kubegpu.model import resources as R

_FILES = {"rbac.yaml": ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"),
          "deployment.yaml": ("Deployment", "Service")}


def _docs(name: str) -> list[dict]:
    """The rendered scheduler objects that came from one base file (or the rendered configuration)."""
    if name == "scheduler-config.yaml":
        return [scheduler_config(Values())]
    return [o for o in scheduler_objects(Values()) if o["kind"] in _FILES[name]]


def test_objects_validate_against_the_kubernetes_schema() -> None:
    for name in ("rbac.yaml", "deployment.yaml"):
        for obj in _docs(name):
            kubernetes_validate.validate(obj, "1.33", strict=True)


def test_extender_entry() -> None:
    (cfg,) = _docs("scheduler-config.yaml")
    assert cfg["apiVersion"] == "kubescheduler.config.k8s.io/v1" and cfg["kind"] == "KubeSchedulerConfiguration"
    ext, binder = cfg["extenders"]
    assert (ext["filterVerb"], ext["prioritizeVerb"], binder["bindVerb"]) == ("filter", "prioritize", "bind")
    assert ext["nodeCacheCapable"] is True and ext["weight"] > 0 and ext["httpTimeout"].endswith("s")
    assert "bindVerb" not in ext and binder["urlPrefix"] == ext["urlPrefix"] and not binder["managedResources"]
    managed = {m["name"]: m["ignoredByScheduler"] for m in ext["managedResources"]}
    for name in (R.NVIDIA_GPU, R.NVIDIA_GPU_SHARED, *R.SHARE_RESOURCES):
        assert name in managed, name
    assert managed[R.GPU_PERCENT] is True  # nothing advertises the shorthand
    assert all(managed[n] is False for n in (R.NVIDIA_GPU, R.GPU_SLOTS, *R.DEVICE_RESOURCES))
    assert all(R.is_mig_resource(n) for n in managed if n.startswith(R.NVIDIA_MIG_PREFIX))
    # The extender listens where the config points (same pod, localhost).
    (dep, _svc) = _docs("deployment.yaml")
    args = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "extender")["args"]
    listen = args[args.index("--listen") + 1]
    assert ext["urlPrefix"].startswith(f"http://{listen}/")
