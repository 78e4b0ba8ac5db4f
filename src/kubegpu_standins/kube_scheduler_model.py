"""kube-scheduler between its filters and its choice, as a model: which nodes reach the extender and how the
extender's scores and the score plugins' combine, for a given KubeSchedulerConfiguration and release.

The extender replay (``bench/extender_replay.py``) calls the real extender directly with every node; in a
cluster, kube-scheduler decides what it sends and what it does with the answer. This model reproduces the
documented rules (kube-scheduler's ``schedule_one.go`` and the noderesources plugins), which a real
v1.36.2 followed in the recording ``shared/fixtures/kubegpu-on-v1.36/turn3-placement.md``:

- **Which nodes are filtered.** kube-scheduler stops filtering once it has found
  ``numFeasibleNodesToFind`` feasible nodes: all of them below 100 nodes; else ``percentageOfNodesToScore``
  of them (the profile's from 1.27, else the global one; 0 means adaptive: 50 - nodes/125 %, at least 5 %),
  at least 100. It starts where the last pod's search stopped (``nextStartNodeIndex`` advances by the nodes
  processed) over the snapshot's node list (one zone: the order the nodes were added). The real search runs
  on 16 goroutines, so a few more nodes may be processed and the found set may differ at the edge of the
  window; the model is the sequential search (exact at 100 %, where every node is processed).
- **What the extender gets.** The feasible nodes, in the order the parallel search filled its array, which
  has no defined order: the model shuffles them (seeded), so the extender must not depend on the order.
- **What decides.** One node left: chosen without scoring. Else each enabled score plugin's score (0..100)
  times its weight, plus the extender's ``score x weight x 10`` (``MaxNodeScore / MaxExtenderPriority``),
  the highest total wins, ties at random. Only ``NodeResourcesFit`` (LeastAllocated over CPU and memory,
  non-zero requests) and ``NodeResourcesBalancedAllocation`` are computed: the other default score plugins
  give every node the same score for the trace's pods (no taints, tolerations, affinities, spread
  constraints, volumes or images), which cannot change the order.
- **What a configuration may hold.** kube-scheduler decodes its configuration strictly: an API version
  the release does not serve, or a field its API version lacks (the profile's ``percentageOfNodesToScore``
  before 1.27), stops it from starting. :func:`profile_model` refuses those with the reason.

Not modelled (kubegpu's profile is not exposed to them): preemption and nominated nodes, opportunistic
batching (1.35+: off for any profile with an extender), PreFilter node subsets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MIN_FEASIBLE_NODES = 100  # minFeasibleNodesToFind
MIN_FEASIBLE_PERCENT = 5  # minFeasibleNodesPercentageToFind
MAX_NODE_SCORE = 100
MAX_EXTENDER_PRIORITY = 10
DEFAULT_CPU_REQUEST = 100  # millicores: schedutil.DefaultMilliCPURequest, for scoring only
DEFAULT_MEMORY_REQUEST = 200 * 2**20  # schedutil.DefaultMemoryRequest

# The default profile's score plugins and weights (multiPoint defaults, every supported release).
DEFAULT_SCORE_WEIGHTS: Mapping[str, int] = {
    "TaintToleration": 3, "NodeAffinity": 2, "NodeResourcesFit": 1, "PodTopologySpread": 2,
    "InterPodAffinity": 2, "NodeResourcesBalancedAllocation": 1, "ImageLocality": 1,
}
MODELLED_PLUGINS = frozenset({"NodeResourcesFit", "NodeResourcesBalancedAllocation"})
# KubeSchedulerProfile fields per config API version (strict decoding refuses any other).
PROFILE_FIELDS = frozenset({"schedulerName", "plugins", "pluginConfig"})
PROFILE_PERCENTAGE_SINCE = (1, 27)


class ConfigRefused(ValueError):
    """A configuration the given kube-scheduler release would refuse to start with; the message says why."""


@dataclass(frozen=True, slots=True)
class ProfileModel:
    """What one profile of a configuration makes kube-scheduler do with a pod, as far as placement goes."""

    release: tuple[int, int]
    percentage: int  # 0 = adaptive
    score_weights: Mapping[str, int] = field(default_factory=dict)  # enabled score plugins
    extender_weight: int = 1
    extender_prioritizes: bool = True
    managed_resources: frozenset[str] | None = None  # None: the extender is interested in every pod

    @property
    def effective(self) -> tuple[int, tuple[tuple[str, int], ...], int, bool]:
        """What changes placement (two releases with the same value place identically)."""
        modelled = tuple(sorted((n, w) for n, w in self.score_weights.items() if n in MODELLED_PLUGINS))
        return self.percentage, modelled, self.extender_weight if modelled else 1, self.extender_prioritizes

    def nodes_to_find(self, nodes: int) -> int:
        return num_feasible_nodes_to_find(self.percentage, nodes)

    def interested(self, resources: Sequence[str]) -> bool:
        """Whether the extender is called for a pod asking these resources (``managedResources``)."""
        return self.managed_resources is None or any(r in self.managed_resources for r in resources)


def api_versions(release: tuple[int, int]) -> frozenset[str]:
    """The KubeSchedulerConfiguration API versions a kube-scheduler release decodes."""
    out = {"kubescheduler.config.k8s.io/v1"} if release >= (1, 25) else set()
    if release <= (1, 25):
        out.add("kubescheduler.config.k8s.io/v1beta3")
    return frozenset(out)


def profile_model(cfg: Mapping[str, Any], release: tuple[int, int], scheduler_name: str) -> ProfileModel:
    """The model of the profile ``scheduler_name`` of a KubeSchedulerConfiguration for a release; raises
    :class:`ConfigRefused` where that release's kube-scheduler would not start."""
    api = cfg.get("apiVersion")
    if api not in api_versions(release):
        raise ConfigRefused(f"{api!r} is not served by kube-scheduler {release[0]}.{release[1]} "
                            f"(it decodes {', '.join(sorted(api_versions(release)))})")
    profiles = [p for p in cfg.get("profiles") or [] if p.get("schedulerName") == scheduler_name]
    if len(profiles) != 1:
        raise ConfigRefused(f"the configuration has {len(profiles)} profiles named {scheduler_name!r}")
    (profile,) = profiles
    allowed = PROFILE_FIELDS | ({"percentageOfNodesToScore"} if release >= PROFILE_PERCENTAGE_SINCE else set())
    unknown = sorted(set(profile) - allowed)
    if unknown:
        raise ConfigRefused(f"strict decoding: unknown field(s) {unknown} in a profile of {api} "
                            f"(kube-scheduler {release[0]}.{release[1]})")
    percentage = profile.get("percentageOfNodesToScore")
    if percentage is None:
        percentage = cfg.get("percentageOfNodesToScore") or 0
    if not 0 <= int(percentage) <= 100:
        raise ConfigRefused(f"percentageOfNodesToScore {percentage} is not in 0..100")
    weights = dict(DEFAULT_SCORE_WEIGHTS)
    score = ((profile.get("plugins") or {}).get("score") or {})
    for p in score.get("disabled") or []:
        if p.get("name") == "*":
            weights.clear()
        else:
            weights.pop(p.get("name"), None)
    for p in score.get("enabled") or []:
        weights[p["name"]] = int(p.get("weight") or DEFAULT_SCORE_WEIGHTS.get(p["name"], 1))
    extenders = cfg.get("extenders") or []
    # kube-scheduler's own checks: one extender binds, and a managed resource is named by one extender only.
    if sum(1 for e in extenders if e.get("bindVerb")) > 1:
        raise ConfigRefused("only one extender can implement bind")
    names = [m["name"] for e in extenders for m in e.get("managedResources") or []]
    if len(names) != len(set(names)):
        raise ConfigRefused("duplicate extender managed resource name")
    # The model follows the one extender that filters; others may only bind (a longer timeout for bind alone).
    filtering = [e for e in extenders if e.get("filterVerb") or e.get("prioritizeVerb")]
    if len(filtering) != 1 or any(e.get("preemptVerb") for e in extenders if e not in filtering):
        raise ConfigRefused(f"the model handles one filtering extender, the configuration has {len(filtering)}")
    (ext,) = filtering
    weight = int(ext.get("weight") or 0)
    if ext.get("prioritizeVerb") and weight <= 0:
        raise ConfigRefused("an extender with a prioritizeVerb needs a positive weight")
    managed = ext.get("managedResources")
    return ProfileModel(
        release=release, percentage=int(percentage), score_weights=weights, extender_weight=weight,
        extender_prioritizes=bool(ext.get("prioritizeVerb")),
        managed_resources=frozenset(m["name"] for m in managed) if managed else None,
    )


def num_feasible_nodes_to_find(percentage: int, nodes: int) -> int:
    """kube-scheduler's ``numFeasibleNodesToFind``."""
    if nodes < MIN_FEASIBLE_NODES:
        return nodes
    if percentage == 0:
        percentage = max(50 - nodes // 125, MIN_FEASIBLE_PERCENT)
    return max(nodes * min(percentage, 100) // 100, MIN_FEASIBLE_NODES)


class NodeSearch:
    """The filter loop over the snapshot's node list, starting where the last search stopped."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.next_start = 0

    def feasible(self, passes: np.ndarray, to_find: int) -> np.ndarray:
        """Indexes of the feasible nodes found, in search order: from ``next_start`` until ``to_find`` of
        ``passes`` (bool over all nodes) are found or every node was processed; then moves the start on by
        the nodes processed (found + failed)."""
        n = self.nodes
        order = (self.next_start + np.arange(n)) % n
        hits = np.flatnonzero(passes[order])
        if len(hits) > to_find:
            processed = int(hits[to_find - 1]) + 1
            found = order[hits[:to_find]]
        else:
            processed = n
            found = order[hits]
        self.next_start = (self.next_start + processed) % n
        return found


def least_allocated(requested: Sequence[np.ndarray], allocatable: Sequence[np.ndarray]) -> np.ndarray:
    """NodeResourcesFit's LeastAllocated score (0..100, integer arithmetic, equal weights) per node."""
    total = np.zeros(len(requested[0]), np.int64)
    weights = np.zeros(len(requested[0]), np.int64)
    for req, cap in zip(requested, allocatable, strict=True):
        ok = cap > 0
        score = np.where(ok & (req <= cap), (np.maximum(cap - req, 0) * MAX_NODE_SCORE) // np.maximum(cap, 1), 0)
        total += score
        weights += ok
    return np.where(weights > 0, total // np.maximum(weights, 1), 0)


def balanced_allocation(requested: Sequence[np.ndarray], allocatable: Sequence[np.ndarray]) -> np.ndarray:
    """NodeResourcesBalancedAllocation's score for CPU and memory: (1 - |f_cpu - f_mem| / 2) x 100, truncated."""
    (cpu, mem), (cpu_cap, mem_cap) = requested, allocatable
    f_cpu = np.minimum(cpu / np.maximum(cpu_cap, 1), 1.0)
    f_mem = np.minimum(mem / np.maximum(mem_cap, 1), 1.0)
    return ((1.0 - np.abs((f_cpu - f_mem) / 2.0)) * MAX_NODE_SCORE).astype(np.int64)


def total_scores(model: ProfileModel, plugin_scores: Mapping[str, np.ndarray], extender: np.ndarray | None,
                 ) -> np.ndarray:
    """The final score per node: each enabled (modelled) plugin's score times its weight, plus the extender's
    score x weight x (MaxNodeScore / MaxExtenderPriority)."""
    n = len(extender) if extender is not None else len(next(iter(plugin_scores.values())))
    total = np.zeros(n, np.int64)
    for name, weight in model.score_weights.items():
        if name in plugin_scores:
            total += weight * plugin_scores[name]
    if extender is not None:
        total += extender * model.extender_weight * (MAX_NODE_SCORE // MAX_EXTENDER_PRIORITY)
    return total


def select_host(total: np.ndarray, rng: np.random.Generator) -> int:
    """The highest total; ties at random (kube-scheduler's per-node ``Randomizer``)."""
    top = np.flatnonzero(total == total.max())
    return int(top[0]) if len(top) == 1 else int(rng.choice(top))
