"""A synchronous agent harness inside an async episode: the harness runs in a thread of its own and
awaits the episode's coroutines (model calls, sandbox commands) on the service's event loop.

The SDK is async (one event loop serves every episode of a service); harnesses such as mini-swe-agent
call their model and their shell synchronously. Running the harness on the loop would block every
other episode, so it runs in a worker thread, and each of its calls is a coroutine submitted to the
loop with `asyncio.run_coroutine_threadsafe`, the calling thread waiting for its result. When the
episode ends early (cancelled, past its deadline) the bridge stops: the call in flight is cancelled on
the loop (a sandbox command is killed, a model request dropped) and it and every later call raise
HarnessStopped in the thread, so the harness ends at once instead of playing on unseen.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Coroutine, TypeVar

T = TypeVar("T")


class HarnessStopped(Exception):
    """Raised in the harness's thread by a call made after its episode ended."""


class LoopBridge:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._stopped = False
        self._in_flight: set[concurrent.futures.Future] = set()

    async def run(self, harness: Callable[..., T], *args: Any) -> T:
        """`harness(*args)` in a thread of its own (not the loop's shared pool: its few workers would make
        episodes queue); its result or its exception. However this ends, the bridge is stopped after."""
        worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="harness")
        try:
            return await self.loop.run_in_executor(worker, harness, *args)
        finally:
            self.stop()
            worker.shutdown(wait=False)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """From the harness's thread: run `coro` on the loop and wait for its result (or exception)."""
        with self._lock:
            if self._stopped:
                coro.close()
                raise HarnessStopped("the episode has ended")
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._in_flight.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise HarnessStopped("the episode has ended") from None
        finally:
            with self._lock:
                self._in_flight.discard(future)

    def stop(self) -> None:
        """Cancel the call in flight; every later call raises HarnessStopped."""
        with self._lock:
            self._stopped = True
            for future in self._in_flight:
                future.cancel()
