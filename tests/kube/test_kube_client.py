"""Building clients from a kubeconfig: a plain-HTTP cluster loads no certificate store (issue 23), an
HTTPS one keeps its verification as configured."""

from __future__ import annotations

import json
from pathlib import Path

from kubegpu.kube.client import load_config, make_client


def _kubeconfig(tmp_path: Path, cluster: dict[str, object]) -> Path:
    path = tmp_path / "kc"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": cluster}], "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    return path


def test_plain_http_cluster_is_not_verified_and_loads_no_certificate_store(tmp_path: Path) -> None:
    path = _kubeconfig(tmp_path, {"server": "http://127.0.0.1:1"})
    assert load_config(path).cluster.insecure
    make_client(path)  # and a client builds from it


def test_https_cluster_keeps_its_verification(tmp_path: Path) -> None:
    assert not load_config(_kubeconfig(tmp_path, {"server": "https://127.0.0.1:1"})).cluster.insecure
    ca = _kubeconfig(tmp_path, {"server": "http://127.0.0.1:1", "certificate-authority": "/nonexistent"})
    assert not load_config(ca).cluster.insecure
