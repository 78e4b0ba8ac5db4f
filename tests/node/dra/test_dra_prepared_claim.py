"""A prepared claim keeps its CDI spec as the file's bytes (issue 23: memory per prepared claim), and the
checkpoint keeps the spec as a JSON object, as before."""

from __future__ import annotations

import json
from pathlib import Path

from kubegpu.node.dra.prepare import Checkpoint, PreparedClaim, PreparedDevice, spec_file

SPEC = {"cdiVersion": "0.6.0", "kind": "k8s.gpu.kubegpu.io/claim",
        "devices": [{"name": "u-gpu-0", "containerEdits": {"env": ["KUBEGPU_REQUEST=gpu"]}}],
        "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=GPU-0"], "deviceNodes": [{"path": "/dev/nvidiactl"}]}}


def test_spec_kept_as_bytes_and_checkpointed_as_an_object(tmp_path: Path) -> None:
    claim = PreparedClaim("ns", "c", "u", [PreparedDevice(("gpu",), "node", "gpu-0", ("k=u-gpu-0",))],
                          spec_file(SPEC))
    assert isinstance(claim.spec_file, bytes) and claim.spec == SPEC
    cp = Checkpoint(tmp_path / "claims")
    cp.save(claim)
    (body,) = [json.loads(f.read_text()) for f in (tmp_path / "claims").glob("*.json")]
    assert body["claim"]["spec"] == SPEC
    assert cp.load() == {"u": claim}
