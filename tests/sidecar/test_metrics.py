"""Prometheus metrics: scraped from a real server's --metrics-port after a few requests."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_proc import ServerProcess, client_for, wait_idle

from pagedserve.sidecar.client import PagedServeError


def scrape(url: str) -> dict[str, float]:
    """{sample name with its labels: value}, e.g. 'pagedserve_requests_total{interface="grpc",outcome="length"}'."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics_endpoint_counts_what_happened(tmp_path):
    srv = ServerProcess(tmp_path, "--metrics-port", "0")
    srv.wait_serving()
    try:
        url = next(a for line in srv.log().splitlines() if '"server.listening"' in line
                   for a in json.loads(line)["addresses"] if a.startswith("http://"))
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url)
        with client_for(srv) as c:
            for i in range(3):
                c.generate_text([5, 6, 7 + i], max_tokens=6, temperature=0.0, ignore_eos=True)
            c.generate_text([5] * 40, max_tokens=2, temperature=0.0, ignore_eos=True)
            c.generate_text([5] * 40, max_tokens=2, temperature=0.0, ignore_eos=True)  # a prefix-cache hit
            with pytest.raises(PagedServeError) as err:
                list(c.generate("hi", top_p=2.0))
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            stream = c.generate([8, 9], max_tokens=500, temperature=0.0, ignore_eos=True)
            next(iter(stream))
            stream.cancel()
            wait_idle(c)
            deadline = time.monotonic() + 10
            while (m := scrape(url)).get('pagedserve_requests_total{interface="grpc",outcome="cancelled"}', 0) < 1:
                assert time.monotonic() < deadline, m
                time.sleep(0.05)
        assert m['pagedserve_requests_total{interface="grpc",outcome="length"}'] == 5
        assert m['pagedserve_requests_total{interface="grpc",outcome="invalid_argument"}'] == 1
        assert m["pagedserve_time_to_first_token_seconds_count"] == 5
        assert m["pagedserve_time_per_output_token_seconds_count"] == 5  # every finished one made > 1 token
        assert m["pagedserve_e2e_request_latency_seconds_count"] == 7
        assert 0 < m["pagedserve_time_to_first_token_seconds_sum"] <= m["pagedserve_e2e_request_latency_seconds_sum"]
        assert m["pagedserve_generation_tokens_total"] == 3 * 6 + 2 * 2
        assert m["pagedserve_prompt_tokens_total"] == 3 * 3 + 2 * 40
        assert m["pagedserve_num_requests_running"] == 0 and m["pagedserve_num_requests_waiting"] == 0
        assert m["pagedserve_kv_cache_usage_perc"] == 0.0
        assert m["pagedserve_prefix_cache_hits_total"] >= 32 and m["pagedserve_prefix_cache_queries_total"] >= 80 + 9
        assert 0 < m["pagedserve_prefix_cache_hit_rate"] < 1
        assert m["pagedserve_num_preemptions_total"] == 0
        assert m["process_resident_memory_bytes"] < m["pagedserve_memory_budget_bytes"]
        assert "pagedserve_engine_output_tokens_per_s" in m  # EngineStats fields without a name of their own
        assert 'pagedserve_requests_total{interface="grpc",outcome="internal"}' not in m
    finally:
        assert srv.stop() == 0, srv.log()


def test_metrics_port_is_off_by_default_and_checked():
    from pagedserve.sidecar.settings import load_settings

    assert load_settings(None, {}).metrics_port is None
    with pytest.raises(ValueError, match="metrics_port must be in"):
        load_settings(None, {"PAGEDSERVE_METRICS_PORT": "70000"})
