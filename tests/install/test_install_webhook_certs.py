"""``kubegpu webhook-certs`` (the no-cert-manager path): an owner-only key and the steps that follow."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

from typer.testing import CliRunner

from kubegpu.cli.main import app
from kubegpu.install.render import render
from kubegpu.install.values import values_from_dict


def test_key_is_owner_only_and_next_steps_are_printed(tmp_path: Path) -> None:
    old = os.umask(0)  # the most permissive umask: the mode must not depend on it
    try:
        result = CliRunner().invoke(app, ["webhook-certs", "--out", str(tmp_path), "--namespace", "gpu"])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE((tmp_path / "tls.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "tls.crt").stat().st_mode) == 0o644
    assert not list(tmp_path.glob("*.tmp"))
    assert "kubectl -n gpu create secret tls kubegpu-webhook-tls" in result.stderr
    assert "certManager: false" in result.stderr
    bundle = result.stdout.strip().splitlines()[-1]
    assert base64.b64decode(bundle) == (tmp_path / "ca.crt").read_bytes()
    # The printed bundle is what the values take, and the render then needs no cert-manager.
    objs = render(values_from_dict({"webhook": {"certManager": False, "caBundle": bundle}}))
    assert not [o for o in objs if o["apiVersion"].startswith("cert-manager.io/")]
    secret = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "kubegpu-webhook")
    assert secret["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"] == "kubegpu-webhook-tls"


def test_rerun_replaces_the_files(tmp_path: Path) -> None:
    for _ in range(2):
        assert CliRunner().invoke(app, ["webhook-certs", "--out", str(tmp_path)]).exit_code == 0
    assert stat.S_IMODE((tmp_path / "tls.key").stat().st_mode) == 0o600
