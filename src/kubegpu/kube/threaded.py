"""An :class:`~kubegpu.kube.informer.Informer` for threaded code (the node daemon's gRPC servers).

The informer is asyncio; this runs it on its own event loop in a daemon thread
and calls the handler there. Handlers must guard what they share with other
threads (a lock); the wrapper only starts, waits for the first list and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from lightkube import AsyncClient, Client

from kubegpu.kube.informer import Informer, WatchEvent


def async_client_like(client: Client) -> AsyncClient:
    """An asyncio client with the same cluster configuration as a synchronous one."""
    return AsyncClient(client.config)


class InformerThread:
    def __init__(self, client: Client | AsyncClient, resource: type, handler: Callable[[WatchEvent], None],
                 **informer_kw: Any) -> None:
        self._client = client
        self._resource = resource
        self._handler = handler
        self._kw = informer_kw
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self.informer: Informer | None = None
        self._synced = threading.Event()

    def start(self) -> InformerThread:
        def run() -> None:
            asyncio.set_event_loop(self._loop)
            client = self._client if isinstance(self._client, AsyncClient) else async_client_like(self._client)
            self.informer = Informer(client, self._resource, self._handler, **self._kw)

            async def main() -> None:
                assert self.informer is not None
                self._task = asyncio.current_task()
                runner = asyncio.create_task(self.informer.run())
                await self.informer.synced.wait()
                self._synced.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await runner

            with contextlib.suppress(asyncio.CancelledError):
                self._loop.run_until_complete(main())

        self._thread = threading.Thread(target=run, name=f"informer-{self._resource.__name__}", daemon=True)
        self._thread.start()
        return self

    def wait_synced(self, timeout_s: float = 10.0) -> bool:
        return self._synced.wait(timeout_s)

    def stop(self) -> None:
        if self.informer is not None:
            self.informer.stop()

        def cancel_all() -> None:
            for t in asyncio.all_tasks(self._loop):
                t.cancel()

        if self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(cancel_all)
            self._thread.join(timeout=5)
