"""Writing acknowledgements off the kubelet's critical path, and until they land.

An ``Allocate`` answer must not wait for the API server: the acknowledgement is what the accounting follows,
but the container's GPUs are decided by the answer alone. So the resolver only *asks* for a pod's
acknowledgement to be written; this writer does it on a pool of threads that grows with the writes due at once
(up to a bound), so that on a slow link each acknowledgement lands one round trip after its ``Allocate`` instead
of queueing behind the others' round trips: how many are in flight is the kubelet's admission rate times the
round trip, which a fixed few do not cover once answers come from the watched view.
Writes of different pods run concurrently (each carries its own UID precondition); writes of one pod never
overlap: a pod asked again while its write is in flight is written again after it, and every write carries the
pod's full current acknowledgement, so the later one supersedes the earlier one and never lands first. A failed
write is retried with back-off (``first_s`` doubling to ``max_s``) for as long as the pod lives: an API server or
a validating webhook that is down only delays the acknowledgement, it never loses it (an acknowledgement refused
during a webhook outage would otherwise never be written).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 32  # at most this many writes in flight per node (threads are started only as writes are due)


class AckWriter:
    """``write(pod_key)`` returns True when there is nothing more to write for the pod (written, already as
    wanted, or the pod is gone) and False to be retried. Keys asked again while queued are written once; a key
    asked again while being written is written once more after that write. ``workers`` bounds the writes in
    flight; a worker is started when a write is due and none is idle."""

    def __init__(self, write: Callable[[str], bool], *, first_s: float = 0.2, max_s: float = 10.0,
                 name: str = "handoff-acks", workers: int = DEFAULT_WORKERS) -> None:
        if workers < 1:
            raise ValueError("an acknowledgement writer needs at least one worker")
        self._write, self.first_s, self.max_s = write, first_s, max_s
        self._cond = threading.Condition()
        self._due: dict[str, float] = {}  # pod -> monotonic time of its next attempt
        self._backoff: dict[str, float] = {}
        self._busy: set[str] = set()  # pods whose write is in flight (never two at once for one pod)
        self._stop = False
        self.failures = 0
        self._name, self._workers = name, workers
        self._threads: list[threading.Thread] = []
        self._idle = 0  # workers started and not writing

    def ask(self, pod_key: str) -> None:
        """Write the pod's acknowledgement now (or as soon as a worker, and the pod's previous write, is done)."""
        with self._cond:
            now = self._due[pod_key] = time.monotonic()
            self._backoff.pop(pod_key, None)
            due = sum(1 for k, t in self._due.items() if t <= now and k not in self._busy)
            if due > self._idle and len(self._threads) < self._workers and not self._stop:
                t = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                self._idle += 1
                t.start()
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._due) + len(self._busy)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _next(self) -> str | None:
        with self._cond:
            while not self._stop:
                now = time.monotonic()
                ready = [(due, key) for key, due in self._due.items() if key not in self._busy]
                if ready:
                    due, key = min(ready)
                    if due <= now:
                        del self._due[key]
                        self._busy.add(key)
                        self._idle -= 1
                        return key
                    self._cond.wait(due - now)
                else:
                    self._cond.wait()
            return None

    def _run(self) -> None:
        while (key := self._next()) is not None:
            try:
                done = self._write(key)
            except Exception:  # never let one write end the writer
                log.exception("acknowledgement of %s: unexpected failure; retrying", key)
                done = False
            with self._cond:
                self._busy.discard(key)
                self._idle += 1
                self._cond.notify_all()  # the pod may have been asked again meanwhile
                if done:
                    self._backoff.pop(key, None)
                    continue
                self.failures += 1
                if key in self._due:
                    continue  # asked again meanwhile: that attempt comes first
                wait = min(self.max_s, self._backoff.get(key, self.first_s / 2) * 2)
                self._backoff[key] = wait
                self._due[key] = time.monotonic() + wait
