"""The engine outputs of one HTTP request, which may be several engine requests (a completions call with a
list of prompts), merged in the order they come as (prompt index, RequestOutput).

    gens[0] --pump--+
    gens[1] --pump--+--> queue --> prime(): every prompt's first output (or its refusal) before any header
    ...             |              __anext__(): then each output as it comes; None marks a prompt's end
                                   aclose(): cancels the pumps; a generator left early aborts its request

Each generator is read by its own task (a pump), so the prompts run side by side in the engine. prime()
raises the first refusal (bad input, full queue), which the caller answers with its status before any
stream starts; the other prompts are then aborted by aclose().
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import anyio

from pagedserve.runtime.outputs import RequestOutput


class Outputs:
    def __init__(self, gens: list[AsyncIterator[RequestOutput]]) -> None:
        self.num_prompts = len(gens)
        self.last: list[RequestOutput | None] = [None] * len(gens)
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        self._buffer: list[tuple[int, RequestOutput | BaseException | None]] = []
        self._left = len(gens)
        self._tasks = [asyncio.get_running_loop().create_task(self._pump(p, g)) for p, g in enumerate(gens)]

    async def _pump(self, p: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await self._queue.put((p, out))
            await self._queue.put((p, None))
        except Exception as e:
            await self._queue.put((p, e))

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
