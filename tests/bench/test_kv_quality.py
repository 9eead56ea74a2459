"""bench/kv_quality.py on the tiny committed Llama (8 prompts x 16 tokens, 512 perplexity tokens): each 16-bit
dtype's figures against float32 KV held within stated bounds, so a regression in the conversions fails.

The bounds: float16 keeps 11 significand bits, so on this model its logprobs move by at most a few hundredths and
no greedy token flips; bfloat16 keeps 8, so a token may flip, but only at a near tie (float32's top-2 margin under
0.25 nats), its logprobs move by well under a nat, and perplexity by under 2%; int8 (7 bits and a sign a row, scaled
by the row's largest) is coarser still: a few more flips, at margins under 1 nat, perplexity within 8%. fp8 keeps
3 (e4m3) or 2 (e5m2) significand bits of each value: this random-weight model's attention scores are large, so a
relative error of 2^-4 moves them by nats and every greedy run flips somewhere; the bounds for it are the mean
|delta logprob| (under 0.15 and 0.3) and perplexity (within 10% and 25%). A conversion with a wrong exponent, byte
order, scale or rounding direction moves these by far more."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench"
TINY = Path(__file__).parents[1] / "data" / "tiny-llama"


def _bench():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("kv_quality", BENCH / "kv_quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_16_bit_kv_quality_within_bounds(tmp_path):
    kv_quality = _bench()
    args = kv_quality.build_parser().parse_args(["--quick", "--model", str(TINY), "--cpu-kernels", "numpy",
                                                 "--dtypes", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2",
                                                 "--out-dir", str(tmp_path)])
    kv_quality.plots.fill_defaults(args, quick={"prompts": 8, "max_tokens": 16, "ppl_tokens": 512}, full={})
    res = kv_quality.run(args)["results"]
    f16, bf16 = res["float16"], res["bfloat16"]
    assert f16["greedy_agreement"] == 1.0 and f16["max_abs_delta_logprob"] < 0.1
    assert abs(f16["perplexity_vs_float32"]) < 0.005
    assert bf16["greedy_agreement"] >= 0.5
    assert all(m is not None and m < 0.25 for m in bf16["float32_top2_margin_at_divergences"])
    assert bf16["max_abs_delta_logprob"] < 1.0 and bf16["mean_abs_delta_logprob"] < 0.05
    assert abs(bf16["perplexity_vs_float32"]) < 0.02
    assert bf16["mean_abs_delta_logprob"] > f16["mean_abs_delta_logprob"] > 0  # the rounding is real, bf16 coarser
    i8 = res["int8"]
    assert i8["greedy_agreement"] >= 0.25
    assert all(m is not None and m < 1.0 for m in i8["float32_top2_margin_at_divergences"])
    assert i8["max_abs_delta_logprob"] < 1.5 and i8["mean_abs_delta_logprob"] < 0.1
    assert abs(i8["perplexity_vs_float32"]) < 0.08
    assert i8["mean_abs_delta_logprob"] > bf16["mean_abs_delta_logprob"]
    e4m3, e5m2 = res["fp8_e4m3"], res["fp8_e5m2"]
    assert e4m3["mean_abs_delta_logprob"] < 0.15 and abs(e4m3["perplexity_vs_float32"]) < 0.10
    assert e5m2["mean_abs_delta_logprob"] < 0.3 and abs(e5m2["perplexity_vs_float32"]) < 0.25
    assert e5m2["mean_abs_delta_logprob"] > e4m3["mean_abs_delta_logprob"] > i8["mean_abs_delta_logprob"]
