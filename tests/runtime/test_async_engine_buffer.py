"""A reader that falls behind: its outputs stay within a bounded buffer plus one merged output, and
what it finally reads is exactly what a prompt reader gets."""

from __future__ import annotations

import time

import anyio
import pytest

from engine_helpers import drain

from pagedserve.models.loading.loader import load_model
from pagedserve.runtime.engine.async_engine import AsyncEngine
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.engine.llm_engine import LLMEngine
from pagedserve.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(data_dir):
    return LLMEngine(EngineConfig(device="cpu", num_kv_blocks=64, seed=0), loaded=load_model(data_dir / "tiny-llama"))


def test_late_reader_gets_every_token_through_a_bounded_buffer(engine):
    params = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=40, ignore_eos=True, logprobs=2)
    engine.add_request("ref", [5, 6, 7], params)
    ref = drain(engine, max_steps=500)
    expected = [c.token_ids for c in ref["ref"].outputs]

    async def main():
        ae = AsyncEngine(engine, stream_buffer_size=2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ae.run)
            gen = ae.generate("late", [5, 6, 7], params)
            first = await gen.__anext__()
            deadline = time.monotonic() + 30
            while "late" in engine.groups:  # read nothing more until the request has finished
                assert time.monotonic() < deadline
                await anyio.sleep(0.01)
            # 40 steps of output went to a reader that took one: 2 buffered, the rest merged into one.
            assert ae._streams["late"].statistics().current_buffer_used == 2 and "late" in ae._overflow
            rest = [o async for o in gen]
            ae.stop()
        return [first, *rest]

    outs = anyio.run(main)
    assert len(outs) == 4 and outs[-1].finished
    got = {0: [], 1: []}
    for o in outs:
        for c in o.outputs:
            got[c.index] += c.new_token_ids
    assert [got[0], got[1]] == expected
    assert [c.token_ids for c in outs[-1].outputs] == expected
    assert len(outs[-1].outputs[0].logprobs) == 40
    assert engine.kv_manager.usage().num_used_blocks == 0


def test_a_long_prompt_is_tokenized_off_the_event_loop(engine):
    """Tokenizing a huge prompt takes seconds: the loop must keep running other work meanwhile, the
    request id is held while it does, and the ids are the ones the plain encode gives."""
    text = "h\u00e9llo w\u00f6rld, " * 40_000  # 520k characters, far past max_model_len in tokens
    tok = engine.tokenizer
    assert tok.encode(text) == tok.backend.encode(text).ids

    async def main():
        ae = AsyncEngine(engine)
        ticks = 0
        done = anyio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await anyio.sleep(0.001)

        async def long_one():
            try:
                with pytest.raises(ValueError, match="exceeds max_model_len"):
                    await ae.generate("long", text, SamplingParams()).__anext__()
            finally:
                done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            tg.start_soon(long_one)
            await anyio.sleep(0)
            with pytest.raises(ValueError, match="already in use"):  # the id is taken while it tokenizes
                await ae.generate("long", [5, 6], SamplingParams()).__anext__()
        assert "long" not in ae._streams
        return ticks

    # Encoding 520k characters takes far longer than the few loop turns a GIL-holding encode would allow.
    assert anyio.run(main) > 20


def test_on_admitted_runs_before_any_output_and_a_failing_one_aborts(engine):
    """The server's admission headers: on_admitted sees the checked request before its first output; if it
    raises (the client went away), the request is aborted like any reader that leaves early."""
    params = SamplingParams(n=1, best_of=3, temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)
    events = []

    async def admitted(group):
        events.append(("admitted", group.request_id, len(group.prompt_token_ids)))

    async def refuse(group):
        raise ConnectionError("the client is gone")

    async def main():
        ae = AsyncEngine(engine)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ae.run)
            async for out in ae.generate("ok", [5, 6, 7], params, on_admitted=admitted):
                events.append(("output", out.finished))
            with pytest.raises(ConnectionError):
                async for _ in ae.generate("gone", [5, 6, 7], params, on_admitted=refuse):
                    pass
            with pytest.raises(ValueError):  # refused before admission: on_admitted never runs
                async for _ in ae.generate("bad", [5, 99999], params, on_admitted=admitted):
                    pass
            deadline = time.monotonic() + 30
            while engine.has_unfinished_requests() or "gone" in ae._streams:
                assert time.monotonic() < deadline
                await anyio.sleep(0.01)
            ae.stop()

    anyio.run(main)
    assert events[0] == ("admitted", "ok", 3) and events[-1] == ("output", True)
    assert [e for e in events if e[0] == "admitted"] == [events[0]]
    assert engine.kv_manager.usage().num_used_blocks == 0
