"""The engine outputs of one HTTP request, which may be several engine requests (a completions call with a
list of prompts), merged in the order they come as (prompt index, RequestOutput).

    gens[0] --pump--+
    gens[1] --pump--+--> queue --> prime(): every prompt's first output (or its refusal) before any header
    ...             |              __anext__(): then each output as it comes; None marks a prompt's end
    (each at most AHEAD outputs    aclose(): cancels the pumps; a generator left early aborts its request
     ahead of the reader)

Each generator is read by its own task (a pump), so the prompts run side by side in the engine. prime()
raises the first refusal (bad input, full queue), which the caller answers with its status before any
stream starts; the other prompts are then aborted by aclose().
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import anyio

from pagedserve.runtime.outputs import RequestOutput


class Outputs:
    # Outputs a prompt may have taken from the engine ahead of the reader. Past that its pump waits, leaving
    # the outputs in the engine's stream, which merges them (AsyncEngine's stream_buffer_size): a stalled
    # client costs O(its request), not O(steps), and no prompt's pump can starve another's.
    AHEAD = 2

    def __init__(self, gens: list[AsyncIterator[RequestOutput]]) -> None:
        self.num_prompts = len(gens)
        self.tenant: str | None = None  # whose requests (a tenants file's name), for the per-tenant metrics
        self.last: list[RequestOutput | None] = [None] * len(gens)
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        self._slots = [asyncio.Semaphore(self.AHEAD) for _ in gens]
        self._buffer: list[tuple[int, RequestOutput | BaseException | None]] = []
        self._left = len(gens)
        self._tasks = [asyncio.get_running_loop().create_task(self._pump(p, g)) for p, g in enumerate(gens)]

    async def _pump(self, p: int, gen: AsyncIterator[RequestOutput]) -> None:
        # aclosing: a pump cancelled while it waits for a slot (not inside the generator) still closes the
        # generator at once, which aborts its request and frees its blocks.
        try:
            async with contextlib.aclosing(gen):
                while True:
                    await self._slots[p].acquire()
                    try:
                        out = await anext(gen)
                    except StopAsyncIteration:
                        break
                    self._queue.put_nowait((p, out))
            self._queue.put_nowait((p, None))
        except Exception as e:
            self._queue.put_nowait((p, e))

    async def prime(self) -> None:
        """Wait until every prompt has its first output or has ended; raise the first error."""
        seen: set[int] = set()
        while len(seen) < self.num_prompts:
            p, item = await self._queue.get()
            if isinstance(item, ValueError) and self.num_prompts > 1 and str(item).startswith("prompt"):
                raise ValueError(f"prompt[{p}]: {item}")  # which of the prompts it is about
            if isinstance(item, BaseException):
                raise item
            seen.add(p)
            self._buffer.append((p, item))

    def __aiter__(self) -> Outputs:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self._left:
            p, item = self._buffer.pop(0) if self._buffer else await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                self._left -= 1
                continue
            self._slots[p].release()
            self.last[p] = item
            return p, item
        raise StopAsyncIteration

    async def collect(self) -> list[RequestOutput | None]:
        """Every prompt's last output (the whole answer)."""
        async for _ in self:
            pass
        return self.last

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):  # the pumps are cancelled: this wait is short
            await asyncio.gather(*self._tasks, return_exceptions=True)
