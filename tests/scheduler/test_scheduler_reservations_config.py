"""The reservation settings reach the extender: ``scheduler.reservation`` values render to the flags
``kubegpu scheduler`` parses, and the flags' defaults are the policy's."""

from __future__ import annotations

from typing import Any

import pytest
from typer.main import get_command

from kubegpu.cli.main import app
from kubegpu.install.render import render
from kubegpu.install.values import values_from_dict
from kubegpu.placement.reservations import ReservationConfig


def _extender_params(raw: dict[str, Any]) -> dict[str, Any]:
    """What ``kubegpu scheduler`` parses from the extender container's rendered args."""
    (args,) = [c["args"] for o in render(values_from_dict(raw)) if o["kind"] == "Deployment"
               for c in o["spec"]["template"]["spec"]["containers"] if c["name"] == "extender"]
    root = get_command(app)
    cmd = root.get_command(root.context_class(root), args[0])  # type: ignore[attr-defined]
    assert cmd is not None
    return dict(cmd.make_context(args[0], list(args[1:])).params)


def _config(params: dict[str, Any]) -> ReservationConfig:
    return ReservationConfig(params["reservation_min_gpus"], params["reservation_wait"],
                             params["reservation_max_share"], enabled=not params["no_reservations"])


def test_the_defaults_are_the_policys() -> None:
    assert _config(_extender_params({})) == ReservationConfig()


@pytest.mark.parametrize(("raw", "expected"), [
    ({"minGpus": 8, "waitSeconds": 30, "maxShare": 0.5}, ReservationConfig(8, 30.0, 0.5)),
    ({"enabled": False}, ReservationConfig(enabled=False)),
])
def test_values_reach_the_extender(raw: dict[str, Any], expected: ReservationConfig) -> None:
    assert _config(_extender_params({"scheduler": {"reservation": raw}})) == expected
