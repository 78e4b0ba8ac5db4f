"""Extender reasons as kube-scheduler's FailedScheduling Event shows them: no ``%``, no leading number.

kube-scheduler formats the reasons into the Event message printf-style and puts the node count in front
(``../shared/fixtures/kubegpu-on-v1.24/scheduler-event-vs-condition.txt``: ``50 %!c(MISSING)ompute``,
``1 1 whole GPU(s)``). The Go format rule is reproduced here: a ``%`` followed by a letter is a verb.
"""

from __future__ import annotations

import re

import pytest

from kubegpu.scheduler import wire
from kubegpu.scheduler.reasons import readable

GO_VERB = re.compile(r"%[-+# 0]*\d*(\.\d+)?[a-zA-Z%]")


def as_event(count: int, reason: str) -> str:
    """What kube-scheduler writes for ``count`` nodes failing with ``reason`` (Go's fmt, verbs unfilled)."""
    text = f"0/{count} nodes are available: {count} {reason}."
    return GO_VERB.sub(lambda m: "%!" + m.group(0)[-1] + "(MISSING)", text)


@pytest.mark.parametrize("reason", [
    "GPU 0: 50 % compute free, 60 % requested",
    "1 whole GPU(s) requested, 0 of 1 free (GPU 0: 50 % compute free)",
    "needs 2 GPU(s) with 30 % compute each: GPU 1: 10 % compute free, 30 % requested",
    "needs 1 MIG 1g.10gb device(s), 0 free",
    "3 whole GPUs requested in all, 1 free",
    "100%",
])
def test_every_reason_survives_the_event_format(reason: str) -> None:
    text = readable(reason)
    assert "%" not in text and "(s)" not in text
    assert not text[0].isdigit()
    assert "MISSING" not in as_event(2, text)
    assert "percent" in text or "%" not in reason


def test_the_filter_result_carries_only_readable_reasons() -> None:
    result = wire.ExtenderFilterResult(None, ["a"], {"b": "GPU 0: 50 % compute free, 60 % requested"},
                                       {"c": "1 whole GPU(s) requested"}, "")
    body = wire.encode(result).decode()
    assert "%" not in body
    assert result.FailedNodes["b"] == "GPU 0: 50 percent compute free, 60 percent requested"
    assert result.FailedAndUnresolvableNodes["c"] == "not enough GPUs: 1 whole GPUs requested"
    assert as_event(1, result.FailedNodes["b"]) == \
        "0/1 nodes are available: 1 GPU 0: 50 percent compute free, 60 percent requested."


def test_the_recorded_garbling_is_what_the_check_catches() -> None:
    assert as_event(1, "50 % compute free") == "0/1 nodes are available: 1 50 %!c(MISSING)ompute free."


def test_readable_reasons_are_sent_as_given_whatever_string_object_holds_them() -> None:
    """A map whose reasons are all readable is encoded as it is (no second map of thousands of nodes),
    also when its texts are equal to, but not the very objects of, texts worded before (the row caches
    word a changed row anew)."""
    first = "not enough GPU compute: GPU 3 has 20 percent free, 50 percent requested"
    assert readable(first) is first
    again = "".join(list(first))  # equal text, another object
    assert again == first and again is not first
    failed = {"n1": again, "n2": again}
    result = wire.ExtenderFilterResult(None, None, failed, {})
    assert result.FailedNodes is failed
    # a reason that needs rewording still gets it
    result = wire.ExtenderFilterResult(None, None, {"n1": again, "n2": "50 % free"}, {})
    assert result.FailedNodes == {"n1": first, "n2": "not enough GPUs: 50 percent free"}
