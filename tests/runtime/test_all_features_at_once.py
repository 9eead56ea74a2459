"""Adapters, a 16-bit KV cache, tenants under fair share and priorities, all on at once, with prefix caching,
copy-on-write (n = 2 samples) and preemption (a pool too small for the batch): every request gets the tokens it
gets alone, the pool's integrity holds after every step (drain), and no block or adapter slot is left held."""

from __future__ import annotations

import pytest

from engine_helpers import drain, make_engine, tiny_loaded
from lora_helpers import make_lora
from pagedserve.runtime.lora import LoRARequest
from pagedserve.runtime.sampling_params import SamplingParams

SHARED = [(3 * i) % 190 + 5 for i in range(40)]  # a common prefix of two and a half blocks: prefix-cache hits
CONFIG = dict(enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_dtype="bfloat16",
              scheduling_policy="fair", tenant_weights={"a": 1.0, "b": 2.0})


def _params(k: int) -> SamplingParams:
    if k % 3 == 0:  # two seeded samples sharing the prompt's blocks (copy-on-write of the partial last block)
        return SamplingParams(n=2, temperature=0.9, top_p=0.95, seed=100 + k, max_tokens=24, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _requests(adapters):
    out = []
    for k in range(12):
        prompt = SHARED + [(7 * k + j) % 180 + 9 for j in range(5 + k)]
        out.append((f"r{k}", prompt, _params(k), dict(tenant="ab"[k % 2], priority=k % 3 // 2,
                                                        lora_request=[None, *adapters][k % 3])))
    return out


def _tokens(outputs, rid):
    return [c.token_ids for c in outputs[rid].outputs]


@pytest.mark.slow
def test_adapters_kv_dtype_tenants_and_priorities_together_equal_alone(tmp_path):
    cfg = tiny_loaded().config
    adapters = [LoRARequest(f"a{k}", k + 1, str(make_lora(tmp_path / f"a{k}", cfg, seed=k + 1, std=0.15, rank=8)))
                for k in range(2)]
    requests = _requests(adapters)
    alone = {}
    for rid, prompt, params, kw in requests:
        e = make_engine(**CONFIG)
        e.add_request(rid, prompt, params, **kw)
        alone[rid] = _tokens(drain(e, integrity=False), rid)
    # 14 blocks of 16 tokens for 12 requests of up to 80 tokens (four of them two samples): preemption is certain
    e = make_engine(**CONFIG, num_kv_blocks=14, max_num_batched_tokens=48)
    for rid, prompt, params, kw in requests:
        e.add_request(rid, prompt, params, **kw)
    together = drain(e)  # the pool's integrity after every step, no block held at the end
    assert e.num_preemptions > 0, "the pool was meant to be small enough to force preemption"
    assert e.get_stats().prefix_cache_hit_rate > 0, "the shared prefix was meant to hit the prefix cache"
    for rid, *_ in requests:
        assert _tokens(together, rid) == alone[rid], rid
    assert not e.lora._held, "an adapter slot is still held by a finished request"
