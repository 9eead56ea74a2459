"""Disaggregated prefill inside one process: two engines, a connector that runs the prefill engine inline.

The sidecar tests run real processes and transports; these pin the engine's side of the contract:
outputs equal a colocated engine's, only missing blocks move, faults free every block and fall back.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import numpy as np
import pytest

import engine_helpers
from engine_helpers import InlineConnector, drain
from pagedserve.runtime.kv_transfer.kv_connector import (KVConnector, KVHandshakeError, KVTransferError,
                                                         check_compatible, chunk_checksums)
from pagedserve.runtime.kv_transfer.kv_shm import ShmSegment
from pagedserve.runtime.core.request import RequestStatus
from pagedserve.runtime.sampling_params import SamplingParams


make_engine = functools.partial(engine_helpers.make_engine, num_kv_blocks=256, block_size=8)


def run(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    return {rid: [c.token_ids for c in out.outputs] for rid, out in drain(engine).items()}


def workload():
    rng = np.random.default_rng(3)
    long = [int(t) for t in rng.integers(3, 500, 90)]
    return [
        ("greedy", long, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
        ("seeded", long[:41], SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)),
        ("n3", long[:33], SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=8, ignore_eos=True)),
        ("short", long[:5], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
    ]


def test_outputs_equal_colocated_and_every_block_is_freed(tiny):
    expected = run(make_engine(tiny), workload())
    prefill = make_engine(tiny, max_num_batched_tokens=24)  # chunked prefill on the prefill side
    decode = make_engine(tiny)
    conn = InlineConnector(prefill)
    decode.enable_remote_prefill(conn)
    assert run(decode, workload()) == expected
    k = decode.kv_stats
    assert k.remote_prefills == 3  # "short" has no full block before its last token: computed locally
    assert k.kv_blocks_received == sum(len(s.dst_block_ids) for s in conn.specs) > 0
    assert k.local_prefill_fallbacks == 0
    assert decode.kv_manager.usage().num_used_blocks == 0 and prefill.kv_manager.usage().num_used_blocks == 0


def test_only_missing_blocks_transfer(tiny):
    decode = make_engine(tiny)
    conn = InlineConnector(make_engine(tiny))
    decode.enable_remote_prefill(conn)
    prompt = list(range(3, 3 + 70))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = run(decode, [("a", prompt, params)])
    run(decode, [("b", prompt[:40] + [9] * 30, params)])  # shares 5 full blocks of 8 with "a"
    assert [s.first_block for s in conn.specs] == [0, 5]
    assert len(conn.specs[1].dst_block_ids) == (70 - 1) // 8 - 5
    assert run(decode, [("c", prompt, params)]) == {"c": first["a"]}  # all here: no third transfer
    assert len(conn.specs) == 2


@pytest.mark.parametrize("fault", ["down", "corrupt"])
def test_faults_fall_back_to_a_local_prefill(tiny, fault):
    expected = run(make_engine(tiny), workload())
    decode = make_engine(tiny)
    prefill = make_engine(tiny)
    decode.enable_remote_prefill(InlineConnector(prefill, fault=fault), fallback="local")
    assert run(decode, workload()) == expected
    assert decode.kv_stats.local_prefill_fallbacks == 3 and decode.kv_stats.remote_prefills == 0
    assert decode.kv_manager.usage().num_used_blocks == 0 and prefill.kv_manager.usage().num_used_blocks == 0


def test_fallback_fail_fails_the_request_and_frees_its_blocks(tiny):
    decode = make_engine(tiny)
    decode.enable_remote_prefill(InlineConnector(make_engine(tiny), fault="down"), fallback="fail")
    decode.add_request("x", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=4))
    assert decode.scheduler.waiting_for_kv["x"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    decode.step()
    failed = decode.take_failed_requests()
    assert [rid for rid, _ in failed] == ["x"] and isinstance(failed[0][1], KVTransferError)
    assert not decode.has_unfinished_requests() and decode.kv_manager.usage().num_used_blocks == 0


def test_abort_while_kv_arrives_frees_its_blocks(tiny):
    decode = make_engine(tiny)

    class Never(KVConnector):
        def __init__(self):
            super().__init__()
            self.aborted = []

        def start_load(self, spec):
            pass

        def abort(self, request_id):
            self.aborted.append(request_id)

    conn = Never()
    decode.enable_remote_prefill(conn)
    decode.add_request("x", list(range(3, 40)), SamplingParams(max_tokens=4))
    assert decode.kv_manager.usage().num_used_blocks == (40 - 3 - 1) // 8
    decode.abort_request("x")
    assert conn.aborted == ["x"] and decode.kv_manager.usage().num_used_blocks == 0
    decode.check_integrity()


def test_a_transport_that_cannot_start_falls_back_at_once(tiny):
    class Broken(KVConnector):
        def start_load(self, spec):
            raise RuntimeError("cannot schedule new futures after shutdown")

    expected = run(make_engine(tiny), workload())
    decode = make_engine(tiny)
    decode.enable_remote_prefill(Broken())
    assert run(decode, workload()) == expected
    assert decode.kv_stats.local_prefill_fallbacks == 3 and decode.kv_manager.usage().num_used_blocks == 0


def test_handshake_names_the_mismatch(tiny):
    spec = make_engine(tiny).kv_transfer_spec("decode")
    ok = make_engine(tiny).kv_transfer_spec("prefill")
    check_compatible(spec, ok, "unix:/p")
    with pytest.raises(KVHandshakeError, match="block_size is 16 there and 8 here"):
        check_compatible(spec, make_engine(tiny, block_size=16).kv_transfer_spec("prefill"), "unix:/p")
    with pytest.raises(KVHandshakeError, match="itself a decode instance"):
        check_compatible(spec, spec, "unix:/p")
    with pytest.raises(KVHandshakeError, match="accepts sequences of up to 64 tokens"):
        check_compatible(spec, make_engine(tiny, max_model_len=64).kv_transfer_spec("prefill"), "unix:/p")


def test_shm_segment_is_ours_only_and_unlinked_by_its_owner(tmp_path):
    shape, dtype = (2, 3, 4), "float32"
    seg = ShmSegment.create(shape, dtype)
    try:
        other = ShmSegment.open(str(seg.path), shape, dtype)
        other.array[:] = 7.0
        other.close()
        assert seg.path.exists() and (seg.array == 7.0).all()  # the sender's close never unlinks
        with pytest.raises(ValueError, match="holds 96 bytes; 192 expected"):
            ShmSegment.open(str(seg.path), (4, 3, 4), dtype)
        stray = tmp_path / seg.path.name
        stray.write_bytes(b"x" * 96)
        with pytest.raises(ValueError, match="is not a pagedserve KV segment"):
            ShmSegment.open(str(stray), shape, dtype)
        with pytest.raises(ValueError, match="is not a pagedserve KV segment"):
            ShmSegment.open(str(seg.path.parent / "passwd"), shape, dtype)
    finally:
        seg.close()
    assert not seg.path.exists()


def test_shm_segment_close_leaves_live_arrays_mapped():
    """The prefill sink may still be copying into a segment's array (engine thread) when a cancelled call
    closes the segment (event loop). Closing must not unmap memory an array points at: before the fix
    this wrote to an unmapped page and killed the process with SIGSEGV, so it runs in a child."""
    code = """if True:
        import gc
        from pagedserve.runtime.kv_transfer.kv_shm import ShmSegment
        seg = ShmSegment.create((64, 1024), "float32")
        sender = ShmSegment.open(str(seg.path), (64, 1024), "float32")
        out = sender.array          # what the sink holds while it copies
        sender.close(); seg.close()  # the call is cancelled; the receiver unlinks
        gc.collect()
        out[:] = 3.0                 # the copy goes on
        print(float(out.sum()))
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.split() == [str(3.0 * 64 * 1024)]


def test_chunk_checksums_cover_every_byte():
    data = bytes(range(256)) * 40
    assert len(chunk_checksums(data, 4096)) == 3
    flipped = bytearray(data)
    flipped[-1] ^= 1
    assert chunk_checksums(data, 4096)[:2] == chunk_checksums(bytes(flipped), 4096)[:2]
    assert chunk_checksums(data, 4096)[2] != chunk_checksums(bytes(flipped), 4096)[2]
