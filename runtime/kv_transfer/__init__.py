"""Disaggregated prefill/decode: KV blocks in and out of the pool, shared memory, remote prefill."""
