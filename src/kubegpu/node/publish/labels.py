"""The node labels NVIDIA's GPU feature discovery (GFD) sets, computed from an inventory + config.

kubegpu's node daemon sets the same keys with the same values GFD would, so nodeSelectors and
affinities written for GFD (``nvidia.com/gpu.product: NVIDIA-A100-SXM4-80GB``) keep working
when kubegpu replaces NVIDIA's plugin. The rules are GFD's (``internal/lm`` of
k8s-device-plugin):

- ``nvidia.com/gpu.{product,count,memory,replicas,sharing-strategy,family,compute.major,
  compute.minor}`` for whole GPUs; ``product`` is sanitised as GFD does (spaces -> ``-``) and ``-SHARED``
  appended when the resource is replicated without a rename; ``replicas`` is 0 for GPUs whose
  MIG mode takes them out of the whole-GPU pool;
- ``nvidia.com/cuda.driver-version.{major,minor,revision,full}``,
  ``nvidia.com/cuda.runtime-version.{major,minor,full}`` and GFD's deprecated
  ``cuda.driver.*`` / ``cuda.runtime.*`` twins;
- ``nvidia.com/mig.capable``, ``nvidia.com/mps.capable``, and ``nvidia.com/mig.strategy``
  when MIG is served;
- MIG ``single``: the ``nvidia.com/gpu.*`` keys describe the MIG device (product
  ``<model>-MIG-<profile>``, its memory, multiprocessors, slices and engines), or
  ``<model>-MIG-INVALID`` with zero counts when the node is not uniform (GFD labels rather than
  fails); ``mixed``: ``nvidia.com/mig-<profile>.{count,product,replicas,sharing-strategy,memory,
  multiprocessors,slices.gi,slices.ci,engines.*}`` per profile (``+`` in a profile becomes
  ``.``, as label keys and resource names cannot hold ``+``);
- ``nvidia.com/gpu.present: "true"`` (the GPU operator's NFD rule) on every GPU node;
- ``alpha.kubernetes.io/nvidia-gpu-name``: the first GPU's name, sanitised as GFD sanitises
  (``Tesla K80`` -> ``Tesla-K80``), the label the Kubernetes 1.6 kubelet set for GPU-model selection.

GFD's timestamp and machine-type labels are not set: they change without the GPUs changing.
Pure function; every value is a valid Kubernetes label value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final

from kubegpu.model import legacy
from kubegpu.model import resources as R
from kubegpu.model.annotations import LEGACY_GPU_NAME_LABEL
from kubegpu.model.inventory import Gpu, MigDevice, NodeInventory
from kubegpu.node.config import Config

PREFIX: Final = "nvidia.com/"
GPU: Final = "nvidia.com/gpu"
_MIB: Final = 2**20
_LABEL_VALUE_RE: Final = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DROPPED_CHARS_RE: Final = re.compile(r"[^-A-Za-z0-9_. ]")

_MIG_ATTRIBUTES: Final = ("multiprocessors", "slices.gi", "slices.ci", "engines.copy", "engines.decoder",
                          "engines.encoder", "engines.jpeg", "engines.ofa")
_RESOURCE_SUFFIXES: Final = ("product", "count", "memory", "replicas", "sharing-strategy", "family",
                             "compute.major", "compute.minor", *_MIG_ATTRIBUTES)
# Keys this module may set, and so may remove when stale; never the GPU operator's
# (gpu.deploy.*, mig.config*) or anyone else's.
_OWNED_RE: Final = re.compile(
    r"^nvidia\.com/("
    r"gpu\.present|mig\.capable|mig\.strategy|mps\.capable|cuda\.[a-z-]+\.[a-z]+"
    r"|(gpu|mig-[0-9a-z.]+)\.(" + "|".join(re.escape(x) for x in _RESOURCE_SUFFIXES) + r"))$")


def arch_family(major: int, minor: int) -> str:
    """GFD's architecture family of a compute capability."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper",
            10: "blackwell", 12: "blackwell"}.get(major, "undefined")


label_value = legacy.label_value  # GFD's sanitise(), one rule for labels and the legacy translation


def is_valid_label_value(value: str) -> bool:
    return len(value) <= 63 and _LABEL_VALUE_RE.match(value) is not None


def owns_label(key: str) -> bool:
    """True for the label keys GFD (and so this module) manages, and the legacy GPU-name label."""
    return key == LEGACY_GPU_NAME_LABEL or _OWNED_RE.match(key) is not None


class _Resource:
    """GFD's resourceLabeler: labels ``<resource>.<suffix>`` with sharing taken from the config."""

    def __init__(self, name: str, config: Config | None) -> None:
        self.name = name
        self.config = config  # None: sharing disabled (GFD's nil config)

    def key(self, suffix: str) -> str:
        return f"{self.name}.{suffix}"

    def _replicas(self) -> tuple[int, bool]:
        if self.config is None:
            return 0, False
        rr = self.config.sharing.replication(self.name)
        if rr is None or rr.replicas <= 1:
            return 1, False
        return rr.replicas, self.config.sharing.active.served_name(rr) != rr.name

    def base(self, count: int, *parts: str) -> dict[str, str]:
        replicas, renamed = self._replicas()
        shared = replicas > 1
        product = "-".join(label_value(p) for p in parts if p)
        if shared and not renamed:
            product += "-SHARED"
        strategy = self.config.sharing.strategy if self.config is not None and shared else "none"
        return {
            self.key("product"): label_value(product),
            self.key("count"): str(count),
            self.key("replicas"): str(replicas),
            self.key("sharing-strategy"): strategy,
        }


def _full_gpu_labels(gpu: Gpu, count: int, config: Config | None) -> dict[str, str]:
    rl = _Resource(GPU, config)
    labels = rl.base(count, gpu.model)
    if gpu.memory_bytes:
        labels[rl.key("memory")] = str(gpu.memory_bytes // _MIB)
    if gpu.compute_capability is not None and gpu.compute_capability[0] != 0:
        major, minor = gpu.compute_capability
        labels[rl.key("family")] = arch_family(major, minor)
        labels[rl.key("compute.major")] = str(major)
        labels[rl.key("compute.minor")] = str(minor)
    return labels


def _mig_labels(resource: str, parent: Gpu, mig: MigDevice, count: int, config: Config) -> dict[str, str]:
    rl = _Resource(resource, config)
    labels = rl.base(count, parent.model, "MIG", mig.profile)
    labels[rl.key("memory")] = str(mig.memory_bytes // _MIB)
    for attr in _MIG_ATTRIBUTES:
        if attr in mig.attributes:
            labels[rl.key(attr)] = str(mig.attributes[attr])
    return labels


def _by_model(gpus: Sequence[Gpu]) -> dict[str, list[Gpu]]:
    out: dict[str, list[Gpu]] = {}
    for g in gpus:
        out.setdefault(g.model, []).append(g)
    return out


def _gpu_resource_labels(inv: NodeInventory, config: Config) -> dict[str, str]:
    strategy = config.flags.mig_strategy
    counts = {model: len(gs) for model, gs in _by_model(inv.gpus).items()}
    labels: dict[str, str] = {}
    enabled = [g for g in inv.gpus if g.mig_enabled and strategy != "none"]
    whole = [g for g in inv.gpus if not (g.mig_enabled and strategy != "none")]
    # MIG-enabled GPUs first, without sharing; whole GPUs of the same model then override them.
    for model, gs in reversed(list(_by_model(enabled).items())):
        labels.update(_full_gpu_labels(gs[0], counts[model], None))
    for model, gs in reversed(list(_by_model(whole).items())):
        labels.update(_full_gpu_labels(gs[0], counts[model], config))
    return labels


def _mig_strategy_labels(inv: NodeInventory, config: Config) -> dict[str, str]:
    strategy = config.flags.mig_strategy
    labels = {"nvidia.com/mig.strategy": strategy}
    enabled = [g for g in inv.gpus if g.mig_enabled]
    if strategy == "single":
        if not enabled:
            return labels
        reason = ""
        if any(not g.mig_devices for g in enabled):
            reason = "at least one MIG device is enabled but empty"
        elif len(enabled) != len(inv.gpus):
            reason = "devices with MIG enabled and disabled detected"
        elif len({m.profile for g in enabled for m in g.mig_devices}) != 1:
            reason = "more than one MIG device type present on node"
        if reason:
            rl = _Resource(GPU, None)
            labels.update({rl.key("product"): label_value(f"{enabled[0].model}-MIG-INVALID"),
                           rl.key("count"): "0", rl.key("replicas"): "0", rl.key("memory"): "0"})
            return labels
        migs = [(g, m) for g in enabled for m in g.mig_devices]
        labels.update(_mig_labels(GPU, migs[0][0], migs[0][1], len(migs), config))
        return labels
    # mixed: one set per profile (GFD ignores MIG-enabled GPUs without MIG devices here).
    first: dict[str, tuple[Gpu, MigDevice]] = {}
    counts: dict[str, int] = {}
    for g in enabled:
        for m in g.mig_devices:
            first.setdefault(m.profile, (g, m))
            counts[m.profile] = counts.get(m.profile, 0) + 1
    for profile in sorted(first):
        g, m = first[profile]
        resource = R.mig_resource(profile)
        labels.update(_mig_labels(resource, g, m, counts[profile], config))
    return labels


def _version_labels(inv: NodeInventory) -> dict[str, str]:
    labels: dict[str, str] = {}
    parts = inv.driver_version.split(".")
    if 2 <= len(parts) <= 3 and all(p.isdigit() for p in parts):
        major, minor, rev = parts[0], parts[1], parts[2] if len(parts) == 3 else ""
        labels.update({
            "nvidia.com/cuda.driver.major": major, "nvidia.com/cuda.driver.minor": minor,
            "nvidia.com/cuda.driver.rev": rev,
            "nvidia.com/cuda.driver-version.major": major, "nvidia.com/cuda.driver-version.minor": minor,
            "nvidia.com/cuda.driver-version.revision": rev,
            "nvidia.com/cuda.driver-version.full": inv.driver_version,
        })
    cuda = inv.cuda_version.split(".")
    if len(cuda) >= 2 and cuda[0].isdigit() and cuda[1].isdigit():
        major, minor = str(int(cuda[0])), str(int(cuda[1]))
        labels.update({
            "nvidia.com/cuda.runtime.major": major, "nvidia.com/cuda.runtime.minor": minor,
            "nvidia.com/cuda.runtime-version.major": major, "nvidia.com/cuda.runtime-version.minor": minor,
            "nvidia.com/cuda.runtime-version.full": f"{major}.{minor}",
        })
    return labels


def gpu_labels(inv: NodeInventory, config: Config) -> dict[str, str]:
    """Every GFD label of this node (empty for a node without GPUs)."""
    if not inv.gpus:
        return {}
    labels: dict[str, str] = {"nvidia.com/gpu.present": "true"}
    # What the Kubernetes 1.6 kubelet set, for pods selecting models the old way (model/legacy.py): the
    # first GPU's name as a valid label value ("Tesla K80" -> "Tesla-K80").
    labels[LEGACY_GPU_NAME_LABEL] = label_value(inv.gpus[0].model)
    labels.update(_version_labels(inv))
    labels["nvidia.com/mig.capable"] = str(any(g.mig_capable or g.mig_enabled for g in inv.gpus)).lower()
    mps = config.sharing.strategy == "mps" and not any(g.mig_enabled for g in inv.gpus)
    labels["nvidia.com/mps.capable"] = str(mps).lower()
    labels.update(_gpu_resource_labels(inv, config))
    if config.flags.mig_strategy != "none":
        labels.update(_mig_strategy_labels(inv, config))
    return labels


def label_changes(current: Mapping[str, str], wanted: Mapping[str, str]) -> dict[str, str | None]:
    """A merge patch for ``metadata.labels``: set what differs, remove owned keys no longer wanted."""
    patch: dict[str, str | None] = {k: v for k, v in wanted.items() if current.get(k) != v}
    patch.update({k: None for k in current if owns_label(k) and k not in wanted})
    return patch
