"""A writer's blocking client on one thread of its own (the influxdb2 writer's ``http.client``, the mysql writer's
PyMySQL): every call of the client runs there, one at a time, so its connection is never shared between threads
and a slow server holds up that writer alone, never the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

_A = TypeVar("_A")
_T = TypeVar("_T")


class OwnThread:
    """The thread (made at the first call) and the closed flag of one writer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._executor: ThreadPoolExecutor | None = None
        self.closed = False

    async def run(self, fn: Callable[[_A], _T], arg: _A) -> _T:
        """``fn(arg)`` on the writer's thread; a ``RuntimeError`` once closed."""
        if self.closed:
            raise RuntimeError(f"{self.name}: the writer is closed")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self.name)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, arg)

    async def close(self, last: Callable[[], None]) -> None:
        """Closed for good: ``last`` (the client's connection dropped) runs on the thread, if it was ever made,
        after the calls before it. A second close does nothing."""
        if self.closed:
            return
        self.closed = True
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.get_running_loop().run_in_executor(executor, last)
            executor.shutdown(wait=False)
