"""YAML files at a bounded cost (kubegpu.model.yaml_text): manifests, the node's config file and topology files
share one loader and one nesting limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubegpu.inventory.topology import TopologyError, load_topology
from kubegpu.model.manifests import ManifestError, load_documents
from kubegpu.model.yaml_text import MAX_YAML_DEPTH, load
from kubegpu.node.config import ConfigError, read_config_file

DEEP = ["[" * 100_000, "[" * 5000 + "]" * 5000, "{a: " * 5000, "a: [" + "[" * 40_000]


@pytest.mark.parametrize("text", DEEP)
def test_every_reader_refuses_deep_nesting_with_the_same_reason(tmp_path: Path, text: str) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    why = f"not valid YAML: nested deeper than {MAX_YAML_DEPTH} levels"
    with pytest.raises(ConfigError, match=why):
        read_config_file(path)
    with pytest.raises(TopologyError, match=why):
        load_topology(path)
    with pytest.raises(ManifestError, match=why):
        load_documents(text)


def test_nesting_up_to_the_limit_loads() -> None:
    text = "[" * MAX_YAML_DEPTH + "1" + "]" * MAX_YAML_DEPTH
    out = load(text)
    for _ in range(MAX_YAML_DEPTH - 1):
        out = out[0]
    assert out == [1]
    assert load("") is None and load("a: 1\n") == {"a": 1}
