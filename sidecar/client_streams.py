"""The streams of the sidecar's client: the chunks of one Generate RPC as they arrive, blocking
(GenerateStream) or asyncio (AsyncGenerateStream). Dropping or closing one cancels the RPC, and the server
then aborts the request and frees its KV cache blocks."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio

from .client_types import Admission, GenerationChunk, PagedServeError, Usage, _admission, _chunk, _error, _from_message


class _Stream:
    """What the two streams share: their state, a response's handling and cancelling the RPC."""

    def __init__(self, call: Any, want_logprobs: bool, request_id: str) -> None:
        self._call = call
        self._want_logprobs = want_logprobs
        self._done = False
        self.request_id: str | None = request_id or None
        self.usage: Usage | None = None
        self._admission: Admission | None = None

    def _take(self, resp: Any) -> GenerationChunk | None:
        """A chunk to hand out, or None (the usage, kept; a kind added to the proto after this client, skipped)."""
        kind = resp.WhichOneof("kind")
        if kind == "chunk":
            return _chunk(resp.chunk, self._want_logprobs)
        if kind == "usage":
            self.usage = _from_message(Usage, resp.usage)
            self.request_id = self.usage.request_id
        return None

    def cancel(self) -> None:
        """Cancel the RPC if it is still running (the server aborts the request). Idempotent."""
        if not self._done:
            self._done = True
            self._call.cancel()


class GenerateStream(_Stream):
    """The chunks of one Generate RPC, as they arrive. After the last chunk, `usage` holds the request's
    token counts and timings and `request_id` its id. `close()` (or leaving a `with` block, or dropping
    the stream before its end) cancels the RPC."""

    def __iter__(self) -> GenerateStream:
        return self

    def admitted(self) -> Admission:
        """Wait for the response headers, which the server sends as soon as it admitted the request (before
        generating anything). Raises PagedServeError if it refused the request (INVALID_ARGUMENT, ...).
        Needs a server that sends them (this version on): an older one sends its headers with the first
        chunk, and this then waits for the end of a stream nobody reads."""
        if self._admission is None:
            admission = _admission(self._call.initial_metadata())
            if admission is None:
                raise PagedServeError(self._call.code(), self._call.details() or "no response headers")
            self._admission = admission
            self.request_id = admission.request_id
        return self._admission

    def __next__(self) -> GenerationChunk:
        while not self._done:
            try:
                resp = next(self._call)
            except StopIteration:
                self._done = True
                break
            except grpc.RpcError as e:
                cancelled_by_us = self._done
                self._done = True
                if cancelled_by_us:
                    break
                raise _error(e) from None
            chunk = self._take(resp)
            if chunk is not None:
                return chunk
        raise StopIteration

    def close(self) -> None:
        """Cancel the RPC if it is still running (the server aborts the request). Idempotent."""
        self.cancel()

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown, channel already closed: nothing left to cancel
            pass


class AsyncGenerateStream(_Stream):
    """The asyncio twin of GenerateStream: `async for chunk in stream`, then `stream.usage`.
    `await stream.aclose()` (or leaving an `async with` block, or dropping it) cancels the RPC."""

    def __aiter__(self) -> AsyncGenerateStream:
        return self

    async def admitted(self) -> Admission:
        """Wait for the response headers (see GenerateStream.admitted)."""
        if self._admission is None:
            admission = _admission(await self._call.initial_metadata())
            if admission is None:
                raise PagedServeError(await self._call.code(), await self._call.details() or "no response headers")
            self._admission = admission
            self.request_id = admission.request_id
        return self._admission

    async def __anext__(self) -> GenerationChunk:
        while not self._done:
            try:
                resp = await self._call.read()
            except grpc.RpcError as e:
                cancelled_by_us = self._done
                self._done = True
                if cancelled_by_us:
                    break
                raise _error(e) from None
            except asyncio.CancelledError:
                if self._done:  # cancel() ran while this read was waiting
                    break
                self.cancel()  # our task is being cancelled: take the RPC down with it
                raise
            if resp is grpc.aio.EOF:
                self._done = True
                break
            chunk = self._take(resp)
            if chunk is not None:
                return chunk
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        try:
            self.cancel()
        except Exception:  # the event loop or channel is already gone
            pass
