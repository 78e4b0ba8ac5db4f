"""A slice of the packaged openb trace written as a user's own node and pod lists, shared by the tests of the
commands and studies that read such lists."""

from __future__ import annotations

from pathlib import Path

from kubegpu.sim.trace import default_path


def trace_slice(tmp_path: Path, n_nodes: int = 40, n_pods: int = 200) -> tuple[Path, Path]:
    """Every 20th GPU node (``n_nodes`` of them) and the first ``n_pods`` pods, with their headers."""
    nodes = default_path("openb_node_list_gpu_node.csv").read_text().splitlines()
    pods = default_path("openb_pod_list_default.csv").read_text().splitlines()
    n, p = tmp_path / "nodes.csv", tmp_path / "pods.csv"
    n.write_text("\n".join([nodes[0], *nodes[1::20][:n_nodes]]) + "\n")
    p.write_text("\n".join([pods[0], *pods[1 : n_pods + 1]]) + "\n")
    return n, p
