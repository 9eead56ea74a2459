"""LoRA through the sidecar: --enable-lora --lora-modules at start, GenerateRequest.lora_name, the Admin service
(load, unload, list; refused without --allow-runtime-lora-updating) and the lora_* stats."""

from __future__ import annotations

import asyncio
import time

import json
import urllib.error
import urllib.request

import grpc
import pytest
from http_helpers import http_address
from server_proc import TINY, ServerProcess, client_for, wait_idle

from lora_helpers import make_lora
from pagedserve.models.config import load_hf_config
from pagedserve.runtime import LLM, LoRARequest, SamplingParams
from pagedserve.sidecar.admin_servicer import AdminServicer
from pagedserve.sidecar.pb import admin_pb2, admin_pb2_grpc, generation_pb2 as pb, generation_pb2_grpc as pb_grpc

PROMPT = [5, 9, 13, 17, 21, 25, 29]


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    root, cfg = tmp_path_factory.mktemp("loras"), load_hf_config(TINY)
    return {name: str(make_lora(root / name, cfg, rank=8, std=0.15, seed=k)) for k, name in enumerate("ab")}


@pytest.fixture(scope="module")
def server(tmp_path_factory, loras):
    srv = ServerProcess(tmp_path_factory.mktemp("srv"), "--enable-lora", "--lora-modules", f"a={loras['a']}",
                        "--max-loras", "2", "--max-lora-rank", "8", "--allow-runtime-lora-updating", "--http-port", "0")
    srv.wait_serving()
    yield srv
    assert srv.stop() == 0, srv.log()


def generate_ids(channel, lora_name: str = "", prompt: list[int] = PROMPT) -> list[int]:
    stub = pb_grpc.GenerationStub(channel)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), lora_name=lora_name,
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return [t for r in stub.Generate(req, timeout=60) if r.HasField("chunk") for t in r.chunk.token_ids]


def test_lora_name_admin_and_stats(server, loras):
    llm = LLM(TINY, device="cpu", seed=0, kv_cache_memory_bytes=64 << 20, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = {name: llm.generate(PROMPT, params, lora_request=LoRARequest(name, k + 1, loras[name]))[0]
            .outputs[0].token_ids for k, name in enumerate("ab")}
    base = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    with grpc.insecure_channel(f"unix:{server.socket}") as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        assert [a.lora_name for a in admin.ListLoRAAdapters(admin_pb2.ListLoRAAdaptersRequest()).adapters] == ["a"]
        assert generate_ids(ch, "a") == want["a"] and generate_ids(ch) == base
        with pytest.raises(grpc.RpcError) as e:
            generate_ids(ch, "b")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'b' not found" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            admin.LoadLoRAAdapter(admin_pb2.LoadLoRAAdapterRequest(lora_name="b", lora_path=loras["b"] + "-missing"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "directory not found" in e.value.details()
        loaded = admin.LoadLoRAAdapter(admin_pb2.LoadLoRAAdapterRequest(lora_name="b", lora_path=loras["b"]))
        assert loaded.lora_name == "b" and loaded.lora_int_id == 2
        assert generate_ids(ch, "b") == want["b"]
        admin.UnloadLoRAAdapter(admin_pb2.UnloadLoRAAdapterRequest(lora_name="b"))
        with pytest.raises(grpc.RpcError) as e:
            admin.UnloadLoRAAdapter(admin_pb2.UnloadLoRAAdapterRequest(lora_name="b"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with client_for(server) as c:
        assert [t for ch in c.generate(PROMPT, lora_name="a", temperature=0.0, max_tokens=6, ignore_eos=True)
                for t in ch.token_ids] == want["a"]  # the client library's lora_name
        wait_idle(c)
        deadline = time.monotonic() + 10  # the idle engine publishes its stats every 0.5 s
        while (s := c.server_stats()).lora_loaded != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (s.lora_loaded, s.lora_resident, s.lora_loads, s.lora_hits, s.lora_evictions) == (1, 1, 2, 1, 0)


class _Aborted(Exception):
    pass


class _Context:
    async def abort(self, code, details):
        raise _Aborted(code, details)


class _Engine:
    lora_enabled = True

    def lora_adapters(self):
        return []


def test_admin_load_and_unload_need_the_flag():
    servicer = AdminServicer(lambda: _Engine(), allow_runtime_lora_updating=False)
    for call, msg in ((servicer.LoadLoRAAdapter, admin_pb2.LoadLoRAAdapterRequest(lora_name="x", lora_path="/x")),
                      (servicer.UnloadLoRAAdapter, admin_pb2.UnloadLoRAAdapterRequest(lora_name="x"))):
        with pytest.raises(_Aborted) as e:
            asyncio.run(call(msg, _Context()))
        code, details = e.value.args
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "allow-runtime-lora-updating" in details
    assert list(asyncio.run(servicer.ListLoRAAdapters(admin_pb2.ListLoRAAdaptersRequest(), _Context())).adapters) == []


def call(url: str, path: str, body: dict | None = None) -> tuple[int, object]:
    """(status, JSON body or text) of a GET (body None) or POST to the HTTP API."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, raw = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def test_http_model_field_models_list_and_load_routes(server, loras):
    url = http_address(server)
    models = call(url, "/v1/models")[1]["data"]
    base_id = models[0]["id"]
    assert {m["id"]: m.get("parent") for m in models}["a"] == base_id
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, with_a = call(url, "/v1/completions", {**body, "model": "a"})
    assert status == 200 and with_a["model"] == "a"
    with grpc.insecure_channel(f"unix:{server.socket}") as ch:  # the gRPC tokens with adapter a, as text
        text = call(url, "/detokenize", {"tokens": generate_ids(ch, "a")})[1]["prompt"]
    assert with_a["choices"][0]["text"] and text.startswith(with_a["choices"][0]["text"])  # (a held-back byte)
    assert call(url, "/v1/completions", {**body, "model": base_id})[1]["choices"][0]["text"] != text
    assert call(url, "/tokenize", {"model": "a", "prompt": "hi"})[0] == 200  # vLLM's routes take adapter names
    status, missing = call(url, "/v1/completions", {**body, "model": "c"})
    assert status == 404 and "'c' does not exist" in missing["error"]["message"]
    status, bad = call(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": loras["a"] + "-nope"})
    assert status == 400 and "directory not found" in bad["error"]["message"]
    status, ok = call(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": loras["b"]})
    assert status == 200 and "added" in ok
    assert call(url, "/v1/completions", {**body, "model": "c"})[0] == 200
    assert call(url, "/v1/unload_lora_adapter", {"lora_name": "c"})[0] == 200
    assert call(url, "/v1/unload_lora_adapter", {"lora_name": "c"})[0] == 404


@pytest.mark.slow
def test_disaggregated_prefill_carries_the_adapter_name(tmp_path_factory, server, loras):
    """A decode instance and a prefill instance that both loaded adapter a: the prompt's blocks are computed on the
    prefill side with a (PrefillRequest.lora_name), and the tokens are the colocated server's."""
    long = [3 + (i * 37) % 400 for i in range(40)]  # two full blocks before the last token
    lora_args = ("--enable-lora", "--lora-modules", f"a={loras['a']}", "--max-lora-rank", "8")
    prefill = ServerProcess(tmp_path_factory.mktemp("prefill"), "--role", "prefill", *lora_args)
    prefill.wait_serving()
    decode = ServerProcess(tmp_path_factory.mktemp("decode"), "--role", "decode", "--prefill-target",
                           "unix:" + prefill.socket, *lora_args)
    try:
        decode.wait_serving()
        with grpc.insecure_channel(f"unix:{server.socket}") as ch:
            want = generate_ids(ch, "a", long)
        with grpc.insecure_channel(f"unix:{decode.socket}") as ch:
            assert generate_ids(ch, "a", long) == want
        with client_for(decode) as c:
            s = wait_idle(c)
            assert s.remote_prefills == 1 and s.local_prefill_fallbacks == 0 and s.kv_blocks_received == 2
    finally:
        assert decode.stop() == 0, decode.log()
        assert prefill.stop() == 0, prefill.log()
