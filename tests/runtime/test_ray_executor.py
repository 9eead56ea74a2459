"""The Ray executor on a real two-node Ray cluster (tests/ray_cluster.py: loopback, started once here).

- CPU: TP=3 on the embedded SmolLM2 through `LLM(..., distributed_executor_backend="ray")` (this process's
  Ray, already initialised) and through `pagedserve serve --distributed-executor ray` (RAY_ADDRESS): the
  TP=1 greedy tokens, every rank on the driver's node; too few CPUs there is refused up front.
- GPU placement only (the nodes declare GPUs; no GPU code runs): packed on the driver's node, spread over
  both when it has too few, refused naming the counts when the cluster has too few.
- Faults: a rank actor's process killed by its pid, and the Ray node under the ranks removed, mid-generation:
  a clear error offline; UNAVAILABLE, NOT_SERVING and exit 3 from the server; no rank process left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import grpc
import pytest
from engine_helpers import wait_until
from ray_cluster import LOOPBACK_ENV, alive, free, hold, start_cluster, stop_cluster
from server_proc import TINY, ServerProcess, client_for
from structlog.testing import capture_logs

from pagedserve.runtime import LLM, SamplingParams
from pagedserve.runtime.executor import WorkerFailedError
from pagedserve.runtime.executor.ray_executor import ray_address
from pagedserve.runtime.executor.ray_placement import gpu_index, place_ranks, reserve_rank0_gpu
from pagedserve.sidecar.client import PagedServeError
from pagedserve.sidecar.server import EXIT_ENGINE_FAILED

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]'; CI installs it)")
pytestmark = pytest.mark.slow

NODE_ENTRY = str(Path(__file__).parents[1] / "ray_node_entry.py")
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
TEXTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
LONG = dict(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster()
    yield c
    stop_cluster(c)


@pytest.fixture(scope="module")
def tp1(smollm2_path):
    """(prompt ids, the TP=1 greedy tokens of each) on the embedded model."""
    with LLM(str(smollm2_path), device="cpu", seed=0, num_kv_blocks=64) as llm:
        prompts = [llm.get_tokenizer().encode(t) for t in TEXTS]
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY))
    return prompts, [o.outputs[0].token_ids for o in out]


# -- placement -------------------------------------------------------------------------------------


def _gpus_free(c, head: int, second: int) -> None:
    """Wait until Ray's per-node view (what placement reads) shows these free GPUs: a reservation made or
    removed reaches it a moment later."""
    wait_until(lambda: (free(ray, c.head_id, "GPU"), free(ray, c.second_id, "GPU")) == (head, second), 30,
               f"{head} and {second} GPUs free on the head and the second node")


def test_gpu_ranks_pack_on_the_driver_node_and_spread_only_when_it_has_too_few(cluster):
    head, second = cluster.head_id, cluster.second_id
    assert ray.get_runtime_context().get_node_id() == head  # this process is the driver, on the head
    _gpus_free(cluster, 2, 2)
    with capture_logs() as logs:
        two = place_ranks(ray, 2, use_gpu=True)
    ray.util.remove_placement_group(two.group)
    assert two.rank_nodes == [head, head]
    assert logs[-1]["event"] == "executor.ray_placement" and logs[-1]["rank_nodes"] == [head, head]
    _gpus_free(cluster, 2, 2)
    three = place_ranks(ray, 3, use_gpu=True)
    try:
        assert three.rank_nodes == [head, head, second]
        holder, device = reserve_rank0_gpu(ray, three, visible=None)  # rank 0's GPU: in its bundle, on the head
        assert device in (0, 1)
        ray.kill(holder)
    finally:
        ray.util.remove_placement_group(three.group)
    _gpus_free(cluster, 2, 2)
    with pytest.raises(ValueError, match=r"needs 5 GPU \(one per rank\) but the Ray cluster has 4 free; free GPUs "
                                         rf"per node: {head[:12]} \(driver\): 2, {second[:12]}: 2"):
        place_ranks(ray, 5, use_gpu=True)
    held = hold(ray, head, "GPU", 1)
    try:
        _gpus_free(cluster, 1, 2)
        spread = place_ranks(ray, 2, use_gpu=True)
        ray.util.remove_placement_group(spread.group)
        assert spread.rank_nodes == [head, second]  # the driver's node had one GPU left
        ray.util.remove_placement_group(held)
        held = hold(ray, head, "GPU", 2)
        _gpus_free(cluster, 0, 2)
        with pytest.raises(ValueError, match="runs rank 0 in this process, so the driver's Ray node needs a free GPU"):
            place_ranks(ray, 2, use_gpu=True)
    finally:
        ray.util.remove_placement_group(held)
    _gpus_free(cluster, 2, 2)


def test_a_ray_client_address_is_refused_naming_it():
    assert ray_address({"RAY_ADDRESS": "10.0.0.1:6379"}) == "10.0.0.1:6379" and ray_address({}) is None
    with pytest.raises(ValueError, match="RAY_ADDRESS='ray://head:10001' is a Ray Client address"):
        ray_address({"RAY_ADDRESS": "ray://head:10001"})


def test_gpu_index_maps_rays_device_id_through_cuda_visible_devices():
    assert gpu_index("1", None) == 1
    assert gpu_index("3", "2,3") == 1
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='0' hides"):
        gpu_index("1", "0")


def test_cpu_ranks_are_refused_up_front_when_the_driver_node_lacks_cpus(cluster, data_dir):
    held = hold(ray, cluster.head_id, "CPU", 1)
    try:
        with pytest.raises(ValueError, match=rf"they need 2 CPU there but node {cluster.head_id[:12]} has 1 free"):
            LLM(str(data_dir / "tiny-qwen2"), device="cpu", num_kv_blocks=64, tensor_parallel_size=3,
                distributed_executor_backend="ray")
    finally:
        ray.util.remove_placement_group(held)
    ours = [g for g in ray.util.placement_group_table().values() if g["name"].startswith("pagedserve-")]
    assert ours and all(g["state"] == "REMOVED" for g in ours)  # the refused attempt reserved nothing
    wait_until(lambda: free(ray, cluster.head_id, "CPU") == 2, 30, "the head's CPUs free again")


# -- TP=3 on CPU, offline and served ---------------------------------------------------------------


def test_tp3_offline_runs_on_the_driver_node_gives_the_tp1_tokens_and_a_killed_rank_fails_clearly(
        cluster, smollm2_path, tp1):
    prompts, want = tp1
    llm = LLM(str(smollm2_path), device="cpu", cpu_threads=1, seed=0, num_kv_blocks=64, tensor_parallel_size=3,
              distributed_executor_backend="ray", collective_timeout_s=30.0)
    ex = llm.engine.executor
    pids = list(ex.rank_pids)
    try:
        assert type(ex).__name__ == "RayExecutor" and len(pids) == 2
        assert ex.rank_nodes == [cluster.head_id] * 3  # the already-initialised Ray's driver node
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY))
        assert [o.outputs[0].token_ids for o in out] == want
        engine = llm.engine
        engine.add_request("long", prompts[0], SamplingParams(**LONG))
        for _ in range(3):
            engine.step()
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerFailedError, match=rf"rank 2 \(Ray actor, pid {pids[1]}, node "
                                                    rf"{cluster.head_id[:12]}\) failed"):
            for _ in range(100):  # the very next step fails; bounded in any case
                engine.step()
        with pytest.raises(WorkerFailedError, match="failed earlier"):
            engine.step()
    finally:
        llm.shutdown()
    wait_until(lambda: not any(alive(p) for p in pids), 30, "the rank actors' processes to end")
    assert ray.is_initialized()  # Ray initialised by its user is left running
    wait_until(lambda: free(ray, cluster.head_id, "CPU") == 2, 30, "the ranks' CPUs free again")


def _started(server: ServerProcess) -> dict:
    for line in server.log().splitlines():
        if '"executor.started"' in line:
            return json.loads(line)
    raise AssertionError(f"no executor.started event in the log:\n{server.log()}")


def _fails_in_flight(server: ServerProcess, prompt: list[int], fault) -> PagedServeError:
    """Start a long request, run `fault` once its first token arrived, return the error the request ends with."""
    errors: list[PagedServeError] = []
    first_chunk = threading.Event()

    def consume() -> None:
        try:
            with client_for(server) as c:
                for _ in c.generate(prompt, **LONG):
                    first_chunk.set()
        except PagedServeError as e:
            errors.append(e)
        finally:
            first_chunk.set()

    t = threading.Thread(target=consume)
    t.start()
    assert first_chunk.wait(60)
    fault()
    t.join(60)
    assert not t.is_alive(), "the in-flight request must end, not hang"
    assert errors and errors[0].code == grpc.StatusCode.UNAVAILABLE, errors
    return errors[0]


def _ends_failed(server: ServerProcess, rank_pids: list[int]) -> None:
    code = server.proc.wait(60)
    log = server.log()
    assert code == EXIT_ENGINE_FAILED, log
    assert '"server.engine_failed"' in log and '"NOT_SERVING"' in log
    wait_until(lambda: not any(alive(p) for p in rank_pids), 30, "the rank actors' processes to end")


def test_tp3_server_on_ray_address_serves_the_tp1_tokens_then_exits_3_when_a_rank_is_killed(
        cluster, smollm2_path, tp1, tmp_path):
    prompts, want = tp1
    server = ServerProcess(tmp_path, "--tensor-parallel-size", "3", "--distributed-executor", "ray",
                           "--max-model-len", "512", model=str(smollm2_path),
                           env={**cluster.env(), "PAGEDSERVE_CPU_THREADS": "1"})
    try:
        server.wait_serving()
        started = _started(server)
        assert started["driver_node"] == cluster.head_id and started["rank_nodes"] == [cluster.head_id] * 3
        with client_for(server) as c:
            got = [[t for ch in c.generate(p, **GREEDY) for t in ch.token_ids] for p in prompts]
        assert got == want
        pids = started["rank_pids"]
        error = _fails_in_flight(server, prompts[0], lambda: os.kill(pids[0], signal.SIGKILL))
        assert f"rank 1 (Ray actor, pid {pids[0]}" in error.message
        _ends_failed(server, pids)
    finally:
        server.stop()
    wait_until(lambda: free(ray, cluster.head_id, "CPU") == 2, 30, "the server's ranks' CPUs free again")


def test_the_ray_node_under_the_ranks_removed_fails_the_server_the_same_way(cluster, tmp_path):
    third = cluster.add_node("127.0.0.3", num_cpus=2)
    server = None
    try:
        server = ServerProcess(tmp_path, "--tensor-parallel-size", "2", "--distributed-executor", "ray",
                               model=TINY, entry=(NODE_ENTRY,),
                               env={**cluster.env(), "TEST_RAY_DRIVER_IP": "127.0.0.3", "PAGEDSERVE_CPU_THREADS": "1"})
        server.wait_serving()
        started = _started(server)
        assert started["rank_nodes"] == [third.node_id] * 2  # the server's own node, not the head
        error = _fails_in_flight(server, [3, 14, 15, 92], lambda: cluster.cluster.remove_node(third))
        third = None
        assert "rank 1 (Ray actor" in error.message, error.message
        _ends_failed(server, started["rank_pids"])
    finally:
        if server is not None:
            server.stop()
        if third is not None:
            cluster.cluster.remove_node(third)


OWN_RAY = textwrap.dedent(f"""
    import json, ray
    from pagedserve.runtime import LLM, SamplingParams
    with LLM({TINY!r}, device="cpu", num_kv_blocks=64, tensor_parallel_size=2,
             distributed_executor_backend="ray") as llm:
        here = ray.get_runtime_context().get_node_id()
        on_driver_node = llm.engine.executor.rank_nodes == [here, here]
        out = llm.generate([[3, 14, 15, 92]], SamplingParams(**{GREEDY!r}))
    print(json.dumps(dict(tokens=out[0].outputs[0].token_ids, on_driver_node=on_driver_node,
                          ray_left_running=ray.is_initialized())))
""")


def test_without_ray_address_the_executor_starts_a_local_ray_and_stops_it():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Ray joins the last cluster `ray start` left in its temp dir (this module's, while it runs): not here.
    tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    try:
        out = subprocess.run([sys.executable, "-c", OWN_RAY], capture_output=True, text=True, timeout=300,
                             env={**env, **LOOPBACK_ENV, "OPENBLAS_NUM_THREADS": "1", "RAY_TMPDIR": tmp})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    with LLM(TINY, device="cpu", num_kv_blocks=64) as llm:
        want = llm.generate([[3, 14, 15, 92]], SamplingParams(**GREEDY))[0].outputs[0].token_ids
    assert got == dict(tokens=want, on_driver_node=True, ray_left_running=False)
