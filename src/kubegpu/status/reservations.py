"""The reservations for waiting wide pods, as ``kubegpu status --extender`` shows them.

Only the extender knows them (they are derived from the pods it is asked to place, and live in its memory), so
they are read from its debug API (``/apis/v1/plugins/DeviceShare/reservations``) beside the node summaries. An
extender that predates reservations answers 404: then there is nothing to show, not an error.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any

import httpx
from rich.markup import escape
from rich.table import Table

from kubegpu.status.sources import SourceError

RESERVATIONS_PATH = "/apis/v1/plugins/DeviceShare/reservations"


def reservations_from_extender(url: str, timeout_s: float = 5.0, ca: str | None = None) -> dict[str, Any] | None:
    """The extender's reservations (None: an extender without them)."""
    try:
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca) if ca else True
        resp = httpx.get(url.rstrip("/") + RESERVATIONS_PATH, timeout=timeout_s, verify=verify)
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        body = resp.json()
    except (httpx.HTTPError, ValueError, OSError) as exc:
        raise SourceError(f"cannot read {url}{RESERVATIONS_PATH}: {exc}") from None
    if not isinstance(body, Mapping) or not isinstance(body.get("reservations"), list):
        raise SourceError(f"{url}{RESERVATIONS_PATH} did not answer the reservations")
    return dict(body)


def reservations_table(data: Mapping[str, Any]) -> Table | None:
    """One row per reservation (pod, node, GPUs held, what it waits for), then the wide pods past the
    threshold the budget could not hold; None when there is nothing to show."""
    items = [r for r in data.get("reservations") or () if isinstance(r, Mapping)]
    without = [str(p) for p in data.get("without_reservation") or ()]
    if not items and not without:
        return None
    table = Table(title=f"Reservations for wide pods ({data.get('reserved_gpus', 0)} GPUs held)", expand=False)
    for col in ("POD", "NODE", "GPUS HELD", "WAITED", "WAITING FOR"):
        table.add_column(col, overflow="fold")
    for r in items:
        gpus = ", ".join(str(g) for g in r.get("gpus") or ())
        table.add_row(escape(str(r.get("pod", ""))), escape(str(r.get("node", ""))), gpus,
                      f"{float(r.get('waited_s') or 0):.0f} s", escape(str(r.get("reason", ""))))
    for pod in without:
        table.add_row(escape(pod), "-", "-", "-",
                      "[yellow]none yet: the budget (maxShare) is spent, or no node can take it[/]")
    return table


__all__ = ["RESERVATIONS_PATH", "reservations_from_extender", "reservations_table"]
