"""Settings from flags and PAGEDSERVE_* variables, down to the EngineConfig they make."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from pagedserve.runtime.config import EngineConfig
from pagedserve.sidecar.settings import Settings, add_settings_arguments, load_settings


def parse(*flags: str, env: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return load_settings(parser.parse_args(list(flags)), env or {})


def test_every_engine_knob_a_server_needs_is_a_setting():
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    # Left to the offline API: tests force pool sizes with num_kv_blocks; the server always uses the
    # weight cache; log_requests is a setting but with the server's own meaning (False = events, no text).
    offline_only = {"num_kv_blocks", "use_weight_cache"}
    renamed = {"distributed_executor_backend": "distributed_executor"}  # the flag is --distributed-executor
    # speculative_config is built from the speculative_* / *_speculative_* / prompt_lookup_* settings;
    # tenant_weights from the --tenants file.
    built = {"speculative_config", "tenant_weights"}
    assert {renamed.get(n, n) for n in engine - offline_only - built} <= {f.name for f in dataclasses.fields(Settings)}


def test_tensor_parallel_settings_from_flags_and_environment():
    config = parse("--tensor-parallel-size", "2", "--distributed-executor", "ray").engine_config()
    assert config.tensor_parallel_size == 2 and config.distributed_executor_backend == "ray"
    config = parse(env={"PAGEDSERVE_TENSOR_PARALLEL_SIZE": "3", "PAGEDSERVE_COLLECTIVE_TIMEOUT_S": "5"}).engine_config()
    assert config.tensor_parallel_size == 3 and config.collective_timeout_s == 5.0
    assert parse().engine_config().distributed_executor_backend == "mp"
    with pytest.raises(ValueError, match="distributed_executor_backend must be 'mp' or 'ray'"):
        parse("--distributed-executor", "slurm")


def test_speculative_decoding_from_flags_and_environment():
    assert parse().engine_config().speculative_config is None
    config = parse("--speculative-method", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-max", "5",
                   "--prompt-lookup-min", "2").engine_config().speculative_config
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == \
        ("ngram", 3, 5, 2)
    config = parse(env={"PAGEDSERVE_SPECULATIVE_MODEL": "/d", "PAGEDSERVE_NUM_SPECULATIVE_TOKENS": "2"}).engine_config()
    assert (config.speculative_config.method, config.speculative_config.model) == ("draft", "/d")
    assert parse("--speculative-draft-layers", "4").engine_config().speculative_config.draft_num_layers == 4
    config = parse("--speculative-method", "suffix", "--suffix-decoding-max-tree-depth", "32",
                   "--suffix-decoding-max-cached-requests", "0", "--suffix-decoding-max-spec-factor", "2",
                   "--suffix-decoding-min-token-prob", "0.2").engine_config().speculative_config
    assert (config.method, config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob) == \
        ("suffix", 32, 0, 2.0, 0.2)
    with pytest.raises(ValueError, match="speculative_config.suffix_decoding_min_token_prob"):
        parse("--speculative-method", "suffix", "--suffix-decoding-min-token-prob", "2")
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        parse("--speculative-method", "ngram", "--num-speculative-tokens", "0")
    with pytest.raises(ValueError, match="speculative_config.method"):
        parse("--speculative-method", "eagle")
    with pytest.raises(ValueError, match="draft_num_layers"):
        parse("--speculative-method", "draft")


def test_cost_aware_chunking_from_flags_and_environment():
    assert parse().engine_config().cost_aware_chunking is True
    assert parse("--no-cost-aware-chunking").engine_config().cost_aware_chunking is False
    assert parse(env={"PAGEDSERVE_COST_AWARE_CHUNKING": "off"}).engine_config().cost_aware_chunking is False


def test_engine_switches_from_flags_and_environment():
    s = parse("--no-enable-prefix-caching", "--no-enable-cuda-graphs", "--cuda-graph-batch-sizes", "4, 1,2")
    config = s.engine_config()
    assert config.enable_prefix_caching is False and config.enable_cuda_graphs is False
    assert config.cuda_graph_batch_sizes == (1, 2, 4)
    env = {"PAGEDSERVE_ENABLE_PREFIX_CACHING": "false", "PAGEDSERVE_CUDA_GRAPH_BATCH_SIZES": "8,16"}
    config = parse(env=env).engine_config()
    assert config.enable_prefix_caching is False and config.cuda_graph_batch_sizes == (8, 16)
    assert parse("--enable-prefix-caching", env=env).engine_config().enable_prefix_caching is True  # flag wins
    assert parse("--cpu-threads", "1").engine_config().cpu_threads == 1
    assert parse(env={"PAGEDSERVE_CPU_THREADS": "3"}).engine_config().cpu_threads == 3
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
        parse("--cpu-threads", "0")
    assert parse("--cpu-threads", "auto").engine_config().cpu_threads == "auto"
    assert parse(env={"PAGEDSERVE_CPU_THREADS": "AUTO"}).engine_config().cpu_threads == "auto"
    with pytest.raises(ValueError, match="--cpu-threads: cannot parse 'fast' as an integer or 'auto'"):
        parse("--cpu-threads", "fast")
    defaults = parse().engine_config()
    assert defaults.enable_prefix_caching and defaults.enable_cuda_graphs and defaults.cuda_graph_batch_sizes is None
    assert defaults.cpu_threads is None


@pytest.mark.parametrize("value,needle", [
    ("1,two", "cuda_graph_batch_sizes must be comma-separated integers like '1,2,4,8', got '1,two'"),
    ("0,4", "cuda_graph_batch_sizes must be a non-empty sequence of integers in [1, max_num_seqs=256]"),
])
def test_bad_batch_sizes_name_the_setting(value, needle):
    with pytest.raises(ValueError) as err:
        parse("--cuda-graph-batch-sizes", value)
    assert needle in str(err.value)


def test_gpu_block_size_is_refused_at_start():
    with pytest.raises(ValueError, match="block_size 8 runs on the CPU backend only"):
        parse("--device", "cuda", "--block-size", "8")
    assert parse("--device", "cpu", "--block-size", "8").engine_config().block_size == 8


def test_serve_starts_the_cpu_kernels_compiles_before_the_server(monkeypatch):
    """`pagedserve serve` begins the CPU kernel set's compiles (start_warm_up) before it builds the server, with
    the settings' device and kernel choice; under tensor parallelism the ranks start their own."""
    from pagedserve.cupy_kernels import backend
    from pagedserve.sidecar import cli, logging_setup, server

    order = []
    monkeypatch.setattr(logging_setup, "configure_logging", lambda **kwargs: None)  # this process' logging as is
    monkeypatch.setattr(backend, "start_warm_up", lambda device, choice: order.append(("warm_up", device, choice)))
    monkeypatch.setattr(server, "run_server", lambda settings: order.append(("server", settings.device)) or 0)
    assert cli.main(["serve", "--device", "cpu", "--cpu-kernels", "numpy"]) == 0
    assert order == [("warm_up", "cpu", "numpy"), ("server", "cpu")]
    order.clear()
    assert cli.main(["serve", "--device", "cpu", "--tensor-parallel-size", "2"]) == 0
    assert order == [("server", "cpu")]


def test_every_setting_has_a_one_line_help_shown_by_serve_help(capsys):
    from pagedserve.sidecar.cli import build_parser

    missing = [f.name for f in dataclasses.fields(Settings) if not str(f.metadata.get("help", "")).strip()]
    assert missing == [], "give these fields a help: opt(default, 'one line')"
    assert all("\n" not in f.metadata["help"] for f in dataclasses.fields(Settings))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare with spaces collapsed
    out = out[out.index("options:"):]
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        entry = out[re.search(rf"(?<![\w-]){flag}[ ,]", out).start():]
        entry = re.split(r"(?<!,) --", entry)[0]  # up to the next flag (a bool's --no- form is its own)
        assert entry.find(" ".join(f.metadata["help"].split())) > 0, (flag, entry)
        assert f"PAGEDSERVE_{f.name.upper()}" in entry, flag
