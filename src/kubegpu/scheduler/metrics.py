"""The extender's Prometheus metrics: verb latency, placements and rejections, GPU allocation, fragmentation.

One registry per extender (no global state, so tests can run several). Allocation and fragmentation are
computed when scraped, from the cluster view, on the extender's event loop: so by default the cluster's
totals only (the GPUs by how much of them is allocated, the allocated share of compute and memory), from
the arrays. Per-GPU series (``per_gpu``) are two per GPU, so a large cluster's answer is large and holds the
loop, and with it every filter, prioritize and bind, for the length of each scrape (docs/performance.md);
``kubegpu status`` and the debug API give each GPU's allocation when asked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kubegpu.scheduler.inflight import InFlight
from kubegpu.scheduler.state import ClusterView

_WAIT_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _ViewCollector(Collector):
    def __init__(self, view: ClusterView, per_gpu: bool) -> None:
        self._view = view
        self._per_gpu = per_gpu

    def collect(self) -> Iterator[GaugeMetricFamily]:
        totals = self._view.gpu_totals()
        gpus = GaugeMetricFamily("kubegpu_cluster_gpus", "GPUs placement may use (healthy, not MIG-enabled), by "
                                 "how much of their compute is allocated: none, some, all", labels=["state"])
        gpus.add_metric(["free"], totals.free)
        gpus.add_metric(["partial"], totals.partial)
        gpus.add_metric(["full"], totals.full)
        yield gpus
        yield GaugeMetricFamily("kubegpu_cluster_gpu_compute_allocated_ratio",
                                "Share of those GPUs' compute allocated", value=totals.compute_allocated)
        yield GaugeMetricFamily("kubegpu_cluster_gpu_memory_allocated_ratio",
                                "Share of those GPUs' memory allocated", value=totals.memory_allocated)
        if self._per_gpu:
            core = GaugeMetricFamily("kubegpu_gpu_compute_allocated_ratio", "Share of a GPU's compute allocated",
                                     labels=["node", "gpu"])
            mem = GaugeMetricFamily("kubegpu_gpu_memory_allocated_ratio", "Share of a GPU's memory allocated",
                                    labels=["node", "gpu"])
            for node, minor, c, m in self._view.gpu_allocation():
                core.add_metric([node, str(minor)], c)
                mem.add_metric([node, str(minor)], m)
            yield core
            yield mem
        frag = GaugeMetricFamily("kubegpu_cluster_fragmentation_milligpu",
                                 "Free GPU compute the expected workload cannot use (milli-GPU)")
        frag.add_metric([], self._view.fragmentation())
        yield frag
        held = GaugeMetricFamily("kubegpu_pods_accounted", "Pods whose GPU allocation is accounted",
                                 labels=["state"])
        assumed = self._view.ledger.assumed_count
        held.add_metric(["confirmed"], len(self._view.ledger.held) - assumed)
        held.add_metric(["assumed"], assumed)
        yield held
        learner = self._view.scoring.learner
        wl = GaugeMetricFamily("kubegpu_learned_workload", "The target workload learned from live pods",
                               labels=["what"])
        wl.add_metric(["live_pods"], learner.live)
        wl.add_metric(["generation"], learner.generation)
        wl.add_metric(["shapes"], len(learner.current))
        yield wl
        bad = GaugeMetricFamily("kubegpu_allocation_annotations_rejected",
                                "Allocation annotations that were unreadable or collided", labels=["why"])
        bad.add_metric(["corrupt"], self._view.ledger.corrupt)
        bad.add_metric(["conflict"], self._view.ledger.conflicts)
        bad.add_metric(["forged"], self._view.ledger.forged)
        yield bad
        col = GaugeMetricFamily("kubegpu_record_collisions", "Live pods whose records exceed a GPU's capacity "
                                "with other pods' (held anyway: those GPUs are full)")
        col.add_metric([], len(self._view.ledger.collisions))
        yield col
        yield from self._reservations()

    def _reservations(self) -> Iterator[GaugeMetricFamily]:
        r = self._view.reservations
        summary: dict[str, Any] = (r.summary() if r is not None else
                                   {"reserved_gpus": 0, "reservations": [], "waiting": {}})
        yield GaugeMetricFamily("kubegpu_reserved_gpus", "GPUs held for waiting wide pods",
                                value=summary["reserved_gpus"])
        count = GaugeMetricFamily("kubegpu_reservations", "Reservations for waiting wide pods, by pod width "
                                  "(whole GPUs)", labels=["width"])
        widths: dict[str, int] = {}
        for item in summary["reservations"]:
            widths[str(item["width"])] = widths.get(str(item["width"]), 0) + 1
        for width, n in sorted(widths.items()):
            count.add_metric([width], n)
        yield count
        longest = GaugeMetricFamily("kubegpu_pods_waiting_longest_seconds", "The longest wait so far of the GPU "
                                    "pods kube-scheduler is placing, by pod width (share or whole GPUs)",
                                    labels=["width"])
        waiting = GaugeMetricFamily("kubegpu_pods_waiting", "GPU pods kube-scheduler is placing, by pod width",
                                    labels=["width"])
        for width, w in sorted(summary["waiting"].items()):
            longest.add_metric([width], w["max_wait_s"])
            waiting.add_metric([width], w["pods"])
        yield longest
        yield waiting


class _InFlightCollector(Collector):
    """What filters did about pods passed by an earlier filter whose binds had not held yet (inflight.py)."""

    def __init__(self, inflight: InFlight) -> None:
        self._inflight = inflight

    def collect(self) -> Iterator[CounterMetricFamily]:
        f = self._inflight
        c = CounterMetricFamily("kubegpu_filter_inflight", "Filters by what the pods in flight made them do: "
                                "unchecked (none in flight), checked (counted them), waited (for their binds), "
                                "refused (a node, for a bind in progress there), expired (binds waited for in vain)",
                                labels=["outcome"])
        for outcome, value in (("unchecked", f.unchecked), ("checked", f.checked), ("waited", f.waited),
                               ("refused", f.refused), ("expired", f.expired)):
            c.add_metric([outcome], value)
        yield c


class ExtenderMetrics:
    def __init__(self, view: ClusterView, *, per_gpu: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram("kubegpu_extender_request_seconds", "Extender verb latency", ["verb"],
                                 buckets=_BUCKETS, registry=self.registry)
        self.placed = Counter("kubegpu_pods_placed_total", "Pods bound with their GPUs recorded",
                              registry=self.registry)
        self.rejected = Counter("kubegpu_node_rejections_total", "Nodes rejected by filter, by reason",
                                ["reason"], registry=self.registry)
        self.unschedulable = Counter("kubegpu_pods_unschedulable_total",
                                     "Filter calls that left a pod no node, by the most common reason", ["reason"],
                                     registry=self.registry)
        self.bind_failures = Counter("kubegpu_bind_failures_total", "Binds that failed, by reason", ["reason"],
                                     registry=self.registry)
        self.bad_requests = Counter("kubegpu_extender_bad_requests_total", "Requests answered 400", ["verb"],
                                    registry=self.registry)
        self.wait = Histogram("kubegpu_pod_wait_seconds", "GPU pods' wait from creation to bound, by pod width "
                              "(share or whole GPUs)", ["width"], buckets=_WAIT_BUCKETS, registry=self.registry)
        self.registry.register(_ViewCollector(view, per_gpu))

    def count_inflight(self, inflight: InFlight) -> None:
        self.registry.register(_InFlightCollector(inflight))
