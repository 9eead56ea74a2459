"""A client that stops reading its stream: RESOURCE_EXHAUSTED after slow_reader_timeout, its blocks
freed while it still holds the stream open, and other streams never notice."""

from __future__ import annotations

import time

import grpc
from server_proc import ServerProcess, client_for

from pagedserve.sidecar.pb import generation_pb2 as pb
from pagedserve.sidecar.pb import generation_pb2_grpc as pb_grpc

# A receive window of 16 KiB that does not grow: the server's writes block as soon as this client
# stops reading (with the default, growing window it could buffer megabytes first).
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]


def test_slow_reader_is_cut_off_and_its_blocks_freed(tmp_path):
    srv = ServerProcess(tmp_path, "--slow-reader-timeout", "1")
    srv.wait_serving()
    try:
        with grpc.insecure_channel(f"unix:{srv.socket}", options=SMALL_WINDOW) as channel:
            req = pb.GenerateRequest(request_id="sleepy", token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                     sampling=pb.SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True,
                                                                logprobs=20))
            stalled = pb_grpc.GenerationStub(channel).Generate(req, timeout=120)
            with client_for(srv) as c:
                # Another stream runs to the end while the first one sits unread.
                other = list(c.generate([9, 10, 11], max_tokens=64, temperature=0.0, ignore_eos=True))
                assert sum(len(ch.token_ids) for ch in other) == 64 and other[-1].finish_reason == "length"
                # The stalled request is aborted and its blocks freed although its stream is still open.
                deadline = time.monotonic() + 60
                while True:
                    s = c.server_stats()
                    if '"request.aborted"' in srv.log() and s.kv_blocks_used == 0 and s.num_running == 0:
                        break
                    assert time.monotonic() < deadline, f"the stalled request was never freed: {s}"
                    time.sleep(0.1)
            # The client reads again: what was in flight, then the status; never the whole 2000 tokens.
            got = 0
            try:
                for msg in stalled:
                    got += len(msg.chunk.token_ids)
                    assert not msg.HasField("usage")
                raise AssertionError("the stalled stream ended OK")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                assert "slow_reader_timeout" in e.details()
            assert 0 < got < 2000
    finally:
        assert srv.stop() == 0, srv.log()
