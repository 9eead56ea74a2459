"""Disaggregated prefill and decode with real server processes on one host (tiny model, both transports).

Every instance uses block size 8 and a 32-token budget, so the long prompts prefill in chunks.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from server_proc import ServerProcess, client_for, wait_idle

from pagedserve.runtime.kv_transfer.kv_shm import PREFIX, shm_dir
from pagedserve.sidecar.client import PagedServeError
from pagedserve.sidecar.settings import Settings

COMMON = ("--block-size", "8", "--max-num-batched-tokens", "32", "--max-model-len", "512")
LONG = [3 + (i * 37) % 500 for i in range(200)]


def start(tmp_path_factory, *args: str, name: str = "srv", model_args: tuple[str, ...] = ()) -> ServerProcess:
    srv = ServerProcess(tmp_path_factory.mktemp(name), *COMMON, *args)
    srv.wait_serving()
    return srv


def decode_args(prefill: ServerProcess | str, *extra: str) -> tuple[str, ...]:
    target = prefill if isinstance(prefill, str) else "unix:" + prefill.socket
    return ("--role", "decode", "--prefill-target", target, *extra)


def tokens(client, prompt, **kw) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for c in client.generate(prompt, **kw):
        out.setdefault(c.index, []).extend(c.token_ids)
    return out


OTHER = [3 + (i * 53 + 11) % 500 for i in range(200)]
WORKLOAD = [
    (LONG, dict(temperature=0.0, max_tokens=10, ignore_eos=True)),  # 200 tokens: chunks of 32
    (OTHER[:77], dict(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)),
    (OTHER[100:150], dict(temperature=1.0, n=3, seed=9, max_tokens=8, ignore_eos=True)),
    (LONG[:60] + [7] * 40, dict(temperature=0.0, max_tokens=6, ignore_eos=True)),  # shares 7 blocks with LONG
    (LONG[:6], dict(temperature=0.0, max_tokens=5, ignore_eos=True)),  # no full block: all local
]


def run_workload(srv: ServerProcess) -> list[dict[int, list[int]]]:
    with client_for(srv) as c:
        return [tokens(c, p, **kw) for p, kw in WORKLOAD]


def segments() -> set[str]:
    return {p.name for p in shm_dir().glob(PREFIX + "*")}


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    srv = start(tmp_path_factory, name="both")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def expected(both):
    return run_workload(both)


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    srv = start(tmp_path_factory, "--role", "prefill", name="prefill")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_outputs_identical_to_one_both_instance(tmp_path_factory, prefill, expected):
    """Two decode instances, one per transport, share the prefill instance and run at the same time."""
    before_segments = segments()
    decodes = {t: start(tmp_path_factory, *decode_args(prefill, "--kv-transport", t), name=f"decode-{t}")
               for t in ("shm", "grpc")}
    try:
        with client_for(prefill) as pc:
            sent0 = pc.server_stats().kv_blocks_sent
        with ThreadPoolExecutor(2) as pool:
            outputs = dict(zip(decodes, pool.map(run_workload, decodes.values())))
        assert outputs == {"shm": expected, "grpc": expected}
        received = 0
        for transport, decode in decodes.items():
            with client_for(decode) as dc:
                d = wait_idle(dc)
                assert d.kv_blocks_used == 0 and d.remote_prefills == 4 and d.local_prefill_fallbacks == 0
                # The 4th prompt's first 7 blocks were already here (prefix cache): only 12 - 7 moved.
                assert d.kv_blocks_received == 24 + 9 + 6 + (12 - 7)
                assert d.kv_bytes_received == d.kv_blocks_received * 2 * 2 * 8 * 1 * 64 * 4 and d.kv_transfer_s > 0
                # Asking again transfers nothing: every full block is in the decode side's prefix cache.
                assert tokens(dc, LONG, **WORKLOAD[0][1]) == expected[0]
                assert dc.server_stats().kv_blocks_received == d.kv_blocks_received
                received += d.kv_blocks_received
            assert f"\"transport\": \"{transport}\"" in decode.log()
        with client_for(prefill) as pc:
            p = wait_idle(pc)
            assert p.kv_blocks_used == 0 and p.kv_blocks_sent - sent0 == received
    finally:
        for decode in decodes.values():
            assert decode.stop() == 0, decode.log()
    assert segments() <= before_segments  # every shared segment was unlinked


def test_prefill_down_falls_back_locally_or_answers_unavailable(tmp_path_factory, expected):
    gone = "unix:" + str(tmp_path_factory.mktemp("gone") / "nobody.sock")
    local = start(tmp_path_factory, *decode_args(gone), name="local")
    fail = start(tmp_path_factory, *decode_args(gone, "--prefill-fallback", "fail"), name="fail")
    try:
        assert run_workload(local) == expected
        with client_for(local) as c:
            assert c.server_stats().local_prefill_fallbacks == 4 and c.health() == "SERVING"
        with client_for(fail) as c:
            with pytest.raises(PagedServeError) as err:
                tokens(c, LONG, max_tokens=4)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE and "prefill-fallback is fail" in str(err.value)
            assert tokens(c, LONG[:6], **WORKLOAD[4][1]) == expected[4]  # nothing to fetch: served here
            assert c.health() == "SERVING" and wait_idle(c).kv_blocks_used == 0
    finally:
        assert local.stop() == 0 and fail.stop() == 0


@pytest.mark.parametrize("fallback", ["local", "fail"])
def test_prefill_slower_than_the_deadline(tmp_path_factory, expected, fallback):
    slow = start(tmp_path_factory, "--role", "prefill", "--kv-test-fault", "delay:30", name="slow")
    decode = start(tmp_path_factory, *decode_args(slow, "--prefill-timeout", "0.5", "--prefill-fallback", fallback))
    try:
        with client_for(decode) as c:
            if fallback == "local":
                assert tokens(c, LONG, **WORKLOAD[0][1]) == expected[0]
                assert c.server_stats().local_prefill_fallbacks == 1
            else:
                with pytest.raises(PagedServeError) as err:
                    tokens(c, LONG, max_tokens=4)
                assert err.value.code == grpc.StatusCode.UNAVAILABLE and "DEADLINE_EXCEEDED" in str(err.value)
            assert wait_idle(c).kv_blocks_used == 0
        with client_for(slow) as c:
            assert wait_idle(c).kv_blocks_used == 0
    finally:
        assert decode.stop() == 0 and slow.stop() == 0


@pytest.mark.parametrize("fault,transport", [("corrupt", "grpc"), ("corrupt", "shm"), ("cut", "grpc"), ("cut", "shm")])
def test_broken_transfer_is_recomputed_locally_once(tmp_path_factory, expected, fault, transport):
    before_segments = segments()
    bad = start(tmp_path_factory, "--role", "prefill", "--kv-test-fault", fault, name="bad")
    # fallback "fail" covers a target that is down or late; data that came broken is always recomputed here.
    decode = start(tmp_path_factory, *decode_args(bad, "--kv-transport", transport, "--prefill-fallback", "fail"))
    try:
        assert run_workload(decode) == expected
        with client_for(decode) as dc, client_for(bad) as bc:
            d = wait_idle(dc)
            assert d.local_prefill_fallbacks == 4 and d.remote_prefills == 0 and d.kv_blocks_used == 0
            assert wait_idle(bc).kv_blocks_used == 0
        assert "transfer broken" in decode.log()
    finally:
        assert decode.stop() == 0 and bad.stop() == 0
    assert segments() <= before_segments


@pytest.mark.slow
def test_smollm2_blocks_cross_grpc_in_several_checksummed_chunks(tmp_path_factory, smollm2_path):
    """SmolLM2's blocks are 720 KiB: a 150-token prompt's 9 blocks take two 4 MiB chunks."""
    from pagedserve.runtime import LLM, SamplingParams

    model = str(smollm2_path)
    prefill = ServerProcess(tmp_path_factory.mktemp("p2"), "--role", "prefill", model=model)
    prefill.wait_serving()
    decode = ServerProcess(tmp_path_factory.mktemp("d2"), *decode_args(prefill, "--kv-transport", "grpc"), model=model)
    try:
        decode.wait_serving()
        prompt = LONG[:150]
        with client_for(decode) as c:
            got = tokens(c, prompt, temperature=0.0, max_tokens=8, ignore_eos=True)[0]
            s = c.server_stats()
        assert s.remote_prefills == 1 and s.kv_blocks_received == 149 // 16
        assert s.kv_bytes_received == 9 * 30 * 2 * 16 * 3 * 64 * 4 > 4 << 20
        llm = LLM(model, device="cpu", seed=0, kv_cache_memory_bytes=64 << 20)
        want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert got == want[0].outputs[0].token_ids
    finally:
        assert decode.stop() == 0 and prefill.stop() == 0


def _stream_outcome(srv: ServerProcess, i: int) -> str:
    try:
        with client_for(srv, timeout=60) as c:
            out = tokens(c, LONG[i:] + LONG[:i], temperature=0.0, max_tokens=6, ignore_eos=True)
        return "done" if len(out[0]) == 6 else "short"
    except PagedServeError as e:
        return e.code.name


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("fallback", ["local", "fail"])
def test_kill_9_of_the_prefill_instance_mid_run(tmp_path_factory, fallback):
    victim = start(tmp_path_factory, "--role", "prefill", "--kv-test-fault", "delay:0.5", name="victim")
    decode = start(tmp_path_factory, *decode_args(victim, "--prefill-fallback", fallback))
    try:
        with ThreadPoolExecutor(8) as pool, client_for(decode) as c:
            futures = [pool.submit(_stream_outcome, decode, i) for i in range(8)]
            wait_for(lambda: c.server_stats().num_waiting > 0)  # transfers in flight
            victim.proc.kill()
            outcomes = [f.result() for f in futures]
            allowed = {"done"} if fallback == "local" else {"done", "UNAVAILABLE"}
            assert set(outcomes) <= allowed, outcomes
            assert c.health() == "SERVING" and wait_idle(c).kv_blocks_used == 0
            assert _stream_outcome(decode, 3) in allowed  # and afterwards, with the target gone
    finally:
        assert decode.stop() == 0
        victim.stop()


@pytest.mark.slow
def test_cancels_during_transfers_leave_no_blocks_on_either_side(tmp_path_factory):
    """Quick variant of bench/disagg.py --leak-check (100 requests)."""
    slowish = start(tmp_path_factory, "--role", "prefill", "--kv-test-fault", "delay:0.3", name="slowish")
    decode = start(tmp_path_factory, *decode_args(slowish))
    try:
        streams = []
        with client_for(decode) as c:
            for i in range(16):
                streams.append(c.generate(LONG[i:] + LONG[:i], max_tokens=6, ignore_eos=True))
            wait_for(lambda: c.server_stats().num_waiting > 0)
            for s in streams[::2]:
                s.cancel()  # while its blocks are on their way
            done = [len(tokens_of(s)) for s in streams[1::2]]
            assert done == [6] * 8
            assert wait_idle(c).kv_blocks_used == 0
            decode_stats = c.server_stats()
        with client_for(slowish) as pc:
            p = wait_idle(pc)
            assert p.kv_blocks_used == 0 and p.num_running == 0
        assert decode_stats.remote_prefills >= 8
        assert '"transport": "shm"' in decode.log()  # kv_transport auto, one host: shared memory
    finally:
        assert decode.stop() == 0 and slowish.stop() == 0


def tokens_of(stream) -> list[int]:
    return [t for c in stream for t in c.token_ids]


def refused_start(tmp_path_factory, *args: str, model: str | None = None) -> str:
    kw = {"model": model} if model else {}
    srv = ServerProcess(tmp_path_factory.mktemp("refused"), *args, **kw)
    code = srv.proc.wait(60)
    log = srv.log()
    srv.stop()
    assert code != 0, log
    return log


def test_bad_targets_are_refused_at_start(tmp_path_factory, prefill):
    decode = start(tmp_path_factory, *decode_args(prefill), name="decode")
    try:
        log = refused_start(tmp_path_factory, *COMMON, *decode_args(decode))
        assert "is itself a decode instance" in log
    finally:
        decode.stop()
    log = refused_start(tmp_path_factory, "--block-size", "16", "--max-model-len", "512", *decode_args(prefill))
    assert "block_size is 8 there and 16 here" in log
    qwen = str(Path(__file__).parent.parent / "data" / "tiny-qwen2")
    log = refused_start(tmp_path_factory, *COMMON, *decode_args(prefill), model=qwen)
    assert "model_name is 'tiny-llama' there" in log


def test_a_target_that_comes_up_later_is_checked_at_the_first_transfer(tmp_path_factory):
    later = tmp_path_factory.mktemp("later")
    decode = start(tmp_path_factory, *decode_args("unix:" + str(later / "ps.sock")), name="early")
    wrong = ServerProcess(later, "--role", "prefill", "--block-size", "16", "--max-model-len", "512")
    try:
        wrong.wait_serving()
        with client_for(decode) as c:
            # Until the channel reconnects (within its 2 s backoff) the target looks down; either way the
            # request is prefilled here and its tokens are right.
            attempts = iter(range(len(LONG)))

            def refused() -> bool:
                i = next(attempts)  # a new prompt each time: a cached one would not ask the target
                assert len(tokens(c, LONG[i:] + LONG[:i], **WORKLOAD[0][1])[0]) == 10
                return "kv.handshake_failed" in decode.log()
            wait_for(refused)
            assert "block_size is 16 there and 8 here" in decode.log()
            assert c.server_stats().remote_prefills == 0 and wait_idle(c).kv_blocks_used == 0
    finally:
        assert decode.stop() == 0 and wrong.stop() == 0


def test_a_tensor_parallel_target_is_refused_at_start(tmp_path_factory):
    tp = start(tmp_path_factory, "--tensor-parallel-size", "2", name="tp")
    try:
        log = refused_start(tmp_path_factory, *COMMON, *decode_args(tp))
        assert "refused the handshake" in log and "tensor parallel" in log
    finally:
        assert tp.stop() == 0, tp.log()


@pytest.mark.parametrize("kwargs,message", [
    (dict(role="decode"), "role decode needs --prefill-target"),
    (dict(role="decode", prefill_target="nohost"), "unix:PATH or HOST:PORT"),
    (dict(role="prefill", prefill_target="unix:/x"), "only for role decode"),
    (dict(role="middle"), "role must be both, prefill or decode"),
    (dict(role="prefill", tensor_parallel_size=2), "needs tensor_parallel_size 1"),
    (dict(prefill_fallback="retry"), "prefill_fallback must be local or fail"),
    (dict(kv_transport="rdma"), "kv_transport must be auto, shm or grpc"),
    (dict(kv_test_fault="delay:soon"), "kv_test_fault must be"),
])
def test_bad_disaggregation_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Settings(**kwargs).validate()


def test_role_settings_from_the_environment():
    from pagedserve.sidecar.settings import load_settings

    s = load_settings(None, {"PAGEDSERVE_ROLE": "decode", "PAGEDSERVE_PREFILL_TARGET": "127.0.0.1:7000",
                             "PAGEDSERVE_PREFILL_FALLBACK": "fail"})
    assert (s.role, s.prefill_target, s.prefill_fallback, s.kv_transport) == ("decode", "127.0.0.1:7000", "fail", "auto")  # noqa: E501
