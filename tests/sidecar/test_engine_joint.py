"""The sidecar's joint with the runtime: it reads the engine only through AsyncEngine's read API, never
through AsyncEngine.engine (the LLMEngine), and its modules stay small enough to read."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

from pagedserve.models.loading.loader import load_model
from pagedserve.runtime.config import EngineConfig
from pagedserve.runtime.engine.async_engine import AsyncEngine
from pagedserve.runtime.engine.llm_engine import LLMEngine
from pagedserve.runtime.outputs import EngineInfo
from pagedserve.runtime.sampling_params import SamplingParams

SIDECAR = Path(__file__).resolve().parents[2] / "sidecar"
GENERATED = SIDECAR / "pb"
# `engine.engine.tokenizer`, `self.engine.engine.shutdown()`, `e = engine.engine`: an AsyncEngine's LLMEngine.
REACH_IN = re.compile(r"\bengine\.engine\b")
MAX_LINES = 400


def _sources() -> list[Path]:
    return [p for p in sorted(SIDECAR.rglob("*.py")) if GENERATED not in p.parents]


def test_the_pattern_matches_what_it_is_for():
    for bad in ("engine.engine.tokenizer.encode(x)", "self.engine.engine.shutdown()", "e = engine.engine"):
        assert REACH_IN.search(bad), bad
    for fine in ("engine.tokenize(x)", "self.engine.shutdown()", "async_engine.engine_stats", "my_engine.engines"):
        assert not REACH_IN.search(fine), fine


def test_sidecar_reaches_the_engine_only_through_async_engine():
    found = [f"{p.relative_to(SIDECAR.parent)}:{i}: {line.strip()}" for p in _sources()
             for i, line in enumerate(p.read_text().splitlines(), 1) if REACH_IN.search(line)]
    assert not found, ("sidecar/ reads AsyncEngine.engine; add what it needs to AsyncEngine's read API "
                       "(runtime/engine/async_engine.py) instead:\n" + "\n".join(found))


def test_sidecar_modules_stay_under_the_size_rule():
    sizes = {str(p.relative_to(SIDECAR.parent)): len(p.read_text().splitlines()) for p in _sources()}
    big = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not big, f"over {MAX_LINES} lines, split by concept: {big}"


@pytest.fixture(scope="module")
def async_engine(data_dir):
    engine = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=64, seed=0, enable_prefix_caching=True),
                       loaded=load_model(data_dir / "tiny-llama"))
    yield AsyncEngine(engine)
    engine.shutdown()


def test_read_api_answers_what_the_servicer_asks(async_engine):
    ae = async_engine
    info = ae.model_info()
    assert isinstance(info, EngineInfo)
    assert info.vocab_size == ae.vocab_size > 0 and info.num_kv_blocks == 64 and info.backend == "numpy"
    assert info.max_model_len > 0 and info.block_size > 0 and info.dtype and info.kernels
    ids = ae.tokenize("hello world")
    assert ids and all(isinstance(t, int) for t in ids)
    plain = ae.tokenize("hello world", add_special_tokens=False)
    assert plain and ids[len(ids) - len(plain):] == plain  # the same text, less any BOS
    assert "hello" in ae.detokenize(ids)
    with pytest.raises(ValueError):
        ae.tokenize(b"bytes")  # type: ignore[arg-type]
    assert ae.memory_budget_bytes > 0
    assert ae.can_send_kv_blocks  # one rank: whole blocks
    assert ae.prefix_cache_counts() == (0, 0)


def test_kv_counters_are_live_copies(async_engine):
    ae = async_engine
    before = ae.kv_transfer_stats()
    ae.count_kv_sent(3, 4096)
    after = ae.kv_transfer_stats()
    assert (after.kv_blocks_sent - before.kv_blocks_sent, after.kv_bytes_sent - before.kv_bytes_sent) == (3, 4096)
    after.kv_blocks_sent += 100  # a copy: the engine's counters are untouched
    assert ae.kv_transfer_stats().kv_blocks_sent == before.kv_blocks_sent + 3


def test_prefix_cache_counts_follow_the_scheduler(async_engine):
    ae = async_engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    async def run_twice():
        async with anyio.create_task_group() as tg:
            tg.start_soon(ae.run)
            for rid in ("a", "b"):
                async for _ in ae.generate(rid, [5] * 40, params):
                    pass
            ae.stop()

    anyio.run(run_twice)
    queried, hit = ae.prefix_cache_counts()
    assert queried >= 80 and hit >= 32
