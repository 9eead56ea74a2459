"""Settings: one object fed by CLI flags and PAGEDSERVE_* environment variables (flags win).

Every field below can be set as `--field-name VALUE` or `PAGEDSERVE_FIELD_NAME=VALUE`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from pagedserve.runtime.config import EngineConfig

DEFAULT_SOCKET = "/run/pagedserve/pagedserve.sock"
ENV_PREFIX = "PAGEDSERVE_"


@dataclass
class Settings:
    # -- model and engine (see runtime.EngineConfig) --
    model: str | None = None
    device: str = "auto"
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    cost_aware_chunking: bool = True  # while decodes run, prefill chunks shrink as their attention grows
    enable_prefix_caching: bool = True
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_cuda_graphs: bool = True
    cuda_graph_batch_sizes: str | None = None  # "1,2,4,8"; None = runtime.cuda_graphs' defaults
    # numpy's BLAS and numba's threads; None = OPENBLAS_NUM_THREADS, else every core; "auto" = follow the
    # measured step cost as the host's load changes (all, half or one of them)
    cpu_threads: int | str | None = None
    cpu_kernels: str = "auto"  # "numba" (compiled), "numpy" (the reference) or "auto" (numba if it imports)
    seed: int | None = 0
    tensor_parallel_size: int = 1  # ranks that split every layer (one process each; one GPU each on GPUs)
    distributed_executor: str = "mp"  # how ranks start: "mp" (local processes) or "ray" (Ray actors, several hosts)
    collective_timeout_s: float = 60.0  # longest wait on another rank before the step fails
    max_logprobs: int = 20  # most top logprobs a request may ask for (vLLM's max_logprobs)
    # -- speculative decoding (runtime.spec_config): off unless a method or a draft model is named --
    speculative_method: str | None = None  # "ngram" | "draft"
    speculative_model: str | None = None  # draft checkpoint (GGUF or HF directory); implies "draft"
    speculative_draft_layers: int | None = None  # draft = the target's first N layers (no checkpoint)
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # -- server --
    socket: str = DEFAULT_SOCKET  # unix domain socket path; "" turns the socket off
    tcp: str | None = None  # "host:port" or ":port" (host defaults to 127.0.0.1)
    metrics_port: int | None = None  # Prometheus metrics on http://127.0.0.1:PORT/metrics; None = off, 0 = any port
    http_port: int | None = None  # the OpenAI-compatible HTTP API (sidecar/http_api.py); None = off, 0 = any port
    http_host: str = "127.0.0.1"  # where the HTTP API listens; any other host exposes it to the network
    api_key: str | None = None  # HTTP API only: requests must carry "Authorization: Bearer KEY"; None = no check
    max_waiting_requests: int = 256
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    slow_reader_timeout: float = 30.0  # seconds a stream may go unread before it ends RESOURCE_EXHAUSTED
    max_prompt_chars: int = 1_000_000  # per text prompt or chat conversation (all its messages)
    max_chat_messages: int = 1024  # messages in one chat conversation
    log_level: str = "info"
    log_requests: bool = False  # put prompts and outputs in the logs
    # -- disaggregated prefill and decode (docs/disaggregation.md) --
    role: str = "both"  # both | prefill | decode
    prefill_target: str | None = None  # decode: the prefill instance, "unix:PATH" or "HOST:PORT"
    prefill_fallback: str = "local"  # decode, when the target is down or late: local | fail
    prefill_timeout: float = 60.0  # decode: seconds a remote prefill (compute + transfer) may take
    kv_transport: str = "auto"  # decode: auto (shared memory on one host, else gRPC) | shm | grpc
    kv_test_fault: str | None = None  # prefill, testing only: corrupt | cut | delay:SECONDS
    # -- KV cache dtype (cupy_kernels/kv_layout.py) --
    kv_cache_dtype: str = "auto"  # KV pool values: auto | float32 | bfloat16 | float16 | int8 | fp8_e4m3 | fp8_e5m2

    def engine_config(self) -> EngineConfig:
        names = {f.name for f in fields(EngineConfig)}
        kwargs = {k: v for k, v in dataclasses.asdict(self).items() if k in names}
        kwargs["log_requests"] = self.log_requests  # False: lifecycle events on, prompts and outputs off
        kwargs["cuda_graph_batch_sizes"] = parse_batch_sizes(self.cuda_graph_batch_sizes)
        kwargs["distributed_executor_backend"] = self.distributed_executor
        kwargs["speculative_config"] = self.speculative_config()
        return EngineConfig(**kwargs)

    def speculative_config(self) -> dict | None:
        """vLLM's speculative_config dict from the flags; None when speculation is off."""
        method = self.speculative_method
        if method is None and (self.speculative_model is not None or self.speculative_draft_layers is not None):
            method = "draft"
        if method is None:
            return None
        config: dict = {"method": method, "num_speculative_tokens": self.num_speculative_tokens}
        if method == "ngram":
            config.update(prompt_lookup_max=self.prompt_lookup_max, prompt_lookup_min=self.prompt_lookup_min)
        else:
            config.update(model=self.speculative_model, draft_num_layers=self.speculative_draft_layers)
        return config

    def tcp_address(self) -> str | None:
        if not self.tcp:
            return None
        host, sep, port = self.tcp.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"tcp must be 'host:port' or ':port', got {self.tcp!r}")
        return f"{host or '127.0.0.1'}:{port}"

    def validate(self) -> None:
        self.engine_config()  # raises ValueError naming the field
        self.tcp_address()
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        for name in ("max_prompt_chars", "max_chat_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty: unset it for no check, or give the key clients must send")
        if not self.slow_reader_timeout > 0:
            raise ValueError(f"slow_reader_timeout must be > 0, got {self.slow_reader_timeout}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if not self.socket and not self.tcp:
            raise ValueError("nothing to listen on: set a unix socket path or a tcp address")
        self._validate_disaggregation()

    def _validate_disaggregation(self) -> None:
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {self.role!r}")
        if self.role != "both" and self.tensor_parallel_size != 1:
            raise ValueError(f"role {self.role} needs tensor_parallel_size 1: under tensor parallelism each rank "
                             f"holds a slice of every KV block, and blocks are handed over whole")
        if self.role == "decode" and not self.prefill_target:
            raise ValueError("role decode needs --prefill-target (PAGEDSERVE_PREFILL_TARGET): the prefill "
                             "instance's address, unix:PATH or HOST:PORT")
        if self.prefill_target:
            if self.role != "decode":
                raise ValueError(f"prefill_target is only for role decode (this instance's role is {self.role})")
            prefill_target_address(self.prefill_target)
        if self.prefill_fallback not in ("local", "fail"):
            raise ValueError(f"prefill_fallback must be local or fail, got {self.prefill_fallback!r}")
        if self.prefill_timeout <= 0:
            raise ValueError(f"prefill_timeout must be > 0 seconds, got {self.prefill_timeout}")
        if self.kv_transport not in ("auto", "shm", "grpc"):
            raise ValueError(f"kv_transport must be auto, shm or grpc, got {self.kv_transport!r}")
        if self.kv_test_fault is not None:
            kind, _, arg = self.kv_test_fault.partition(":")
            if kind not in ("corrupt", "cut", "delay") or (kind == "delay" and not _is_float(arg)):
                raise ValueError(f"kv_test_fault must be corrupt, cut or delay:SECONDS, got {self.kv_test_fault!r}")


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def prefill_target_address(target: str) -> str:
    """'unix:/run/p.sock' or 'host:port' -> a gRPC target; ValueError for anything else."""
    if target.startswith("unix:"):
        if len(target) <= len("unix:"):
            raise ValueError(f"prefill_target {target!r}: the unix socket path is missing")
        return target
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"prefill_target must be unix:PATH or HOST:PORT, got {target!r}")
    return target


def parse_batch_sizes(text: str | None) -> tuple[int, ...] | None:
    """'1, 2,4' -> (1, 2, 4); None or blank -> None (EngineConfig checks the values themselves)."""
    if text is None or not text.strip():
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"cuda_graph_batch_sizes must be comma-separated integers like '1,2,4,8', "
                         f"got {text!r}") from None


def int_or_auto(text: str) -> int | str:
    """A count, or the word auto."""
    return "auto" if text.strip().lower() == "auto" else int(text)


int_or_auto.__name__ = "an integer or 'auto'"


def _field_type(f: dataclasses.Field) -> Any:
    t = str(f.type)
    if "bool" in t:
        return bool
    if "int" in t and "str" in t:
        return int_or_auto
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def _parse(value: str, typ: type, name: str) -> Any:
    if value.lower() in ("none", "") and typ is not str:
        return None
    try:
        if typ is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        return typ(value)
    except ValueError:
        raise ValueError(f"{name}: cannot parse {value!r} as {typ.__name__}") from None


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """One --flag per Settings field; defaults are None so the environment can fill what flags leave."""
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        typ = _field_type(f)
        help_default = f"env {ENV_PREFIX}{f.name.upper()}; default {f.default!r}"
        if typ is bool:
            parser.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                                help=help_default)
        else:
            parser.add_argument(flag, dest=f.name, default=None, type=str, help=help_default)


def load_settings(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(Settings):
        typ = _field_type(f)
        env = environ.get(ENV_PREFIX + f.name.upper())
        if env is not None:
            values[f.name] = _parse(env, typ, ENV_PREFIX + f.name.upper())
        flag = getattr(args, f.name, None) if args is not None else None
        if flag is not None:
            values[f.name] = flag if isinstance(flag, bool) else _parse(flag, typ, "--" + f.name.replace("_", "-"))
    settings = Settings(**values)
    settings.validate()
    return settings
