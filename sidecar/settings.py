"""Settings: one object fed by CLI flags and PAGEDSERVE_* environment variables (flags win).

Every field below can be set as `--field-name VALUE` or `PAGEDSERVE_FIELD_NAME=VALUE`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from pagedserve.runtime.config import EngineConfig

DEFAULT_SOCKET = "/run/pagedserve/pagedserve.sock"
ENV_PREFIX = "PAGEDSERVE_"


def opt(default: Any, help: str) -> Any:
    """A Settings field with its one-line help (shown by `pagedserve serve --help`, beside its env variable)."""
    return field(default=default, metadata={"help": help})


@dataclass
class Settings:
    # Each field: opt(default, "one line of help"). A new field goes at the end of its group, in the same form.
    # -- model and engine (see runtime.EngineConfig) --
    model: str | None = opt(None, "a .gguf file or a Hugging Face model directory; unset = the embedded SmolLM2")
    device: str = opt("auto", "auto | cpu | cuda (auto: cuda when a GPU and CuPy are present)")
    max_model_len: int | None = opt(None, "longest prompt plus output in tokens; unset = the model's context length")
    max_num_batched_tokens: int = opt(2048, "tokens computed per engine step (the step's token budget)")
    max_num_seqs: int = opt(256, "most sequences running at once")
    enable_chunked_prefill: bool = opt(True, "cut long prompts into chunks that share steps with running decodes")
    cost_aware_chunking: bool = opt(True, "while decodes run, prefill chunks shrink as their attention grows")
    enable_prefix_caching: bool = opt(True, "reuse the KV blocks of prompt prefixes seen before")
    block_size: int = opt(16, "tokens per KV cache block: 8, 16 or 32")
    kv_cache_memory_bytes: int | None = opt(None, "CPU: bytes for the KV pool; unset = 4 GiB (vLLM's CPU default)")
    gpu_memory_utilization: float = opt(0.9, "GPU: fraction of free memory after the weights given to the KV pool")
    enable_cuda_graphs: bool = opt(True, "GPU: replay decode steps as CUDA graphs")
    cuda_graph_batch_sizes: str | None = opt(None, 'GPU: decode batch sizes captured, e.g. "1,2,4,8"; '
                                             "unset = runtime.cuda_graphs' defaults")
    cpu_threads: int | str | None = opt(None, "numpy's BLAS and numba's threads; unset = OPENBLAS_NUM_THREADS, else "
                                        "every core; auto = follow the measured step cost as the load changes")
    cpu_kernels: str = opt("auto", "numba (compiled) | numpy (the reference) | auto (numba if it imports)")
    seed: int | None = opt(0, "seeds the sampler for requests with no seed of their own; unset = random")
    tensor_parallel_size: int = opt(1, "ranks that split every layer (one process each; one GPU each on GPUs)")
    distributed_executor: str = opt("mp", "how ranks start: mp (local processes) | ray (Ray actors, several hosts)")
    collective_timeout_s: float = opt(60.0, "longest wait in seconds on another rank before the step fails")
    max_logprobs: int = opt(20, "most top logprobs a request may ask for (vLLM's max_logprobs)")
    # -- speculative decoding (runtime.spec_config): off unless a method or a draft model is named --
    speculative_method: str | None = opt(None, "speculative decoding: ngram | suffix | draft; unset = off")
    speculative_model: str | None = opt(None, "draft checkpoint (GGUF or HF directory); implies draft")
    speculative_draft_layers: int | None = opt(None, "draft = the target's first N layers (no checkpoint)")
    num_speculative_tokens: int = opt(4, "tokens proposed per step when speculating")
    prompt_lookup_max: int = opt(4, "ngram: longest n-gram looked up in the context")
    prompt_lookup_min: int = opt(2, "ngram: shortest n-gram looked up in the context")
    suffix_decoding_max_tree_depth: int = opt(24, "suffix: depth of the suffix trees (longest match and draft)")
    suffix_decoding_max_cached_requests: int = opt(10000, "suffix: earlier requests' outputs kept (LRU); 0 = none")
    suffix_decoding_max_spec_factor: float = opt(1.0, "suffix: drafts per matched token")
    suffix_decoding_min_token_prob: float = opt(0.1, "suffix: lowest estimated probability of a draft token")
    # -- server --
    socket: str = opt(DEFAULT_SOCKET, 'gRPC unix domain socket path; "" turns the socket off')
    tcp: str | None = opt(None, 'gRPC over TCP: "host:port" or ":port" (host defaults to 127.0.0.1); unset = off')
    metrics_port: int | None = opt(None, "Prometheus metrics on http://127.0.0.1:PORT/metrics; unset = off, "
                                   "0 = any free port")
    http_port: int | None = opt(None, "the OpenAI-compatible HTTP API's port; unset = off, 0 = any free port")
    http_host: str = opt("127.0.0.1", "where the HTTP API listens; any other host exposes it to the network")
    api_key: str | None = opt(None, 'HTTP API: requests must carry "Authorization: Bearer KEY"; unset = no check')
    max_waiting_requests: int = opt(256, "requests queued before new ones are refused (RESOURCE_EXHAUSTED, 429)")
    drain_timeout: float = opt(30.0, "seconds in-flight requests get after SIGTERM")
    slow_reader_timeout: float = opt(30.0, "seconds a stream may go unread before it ends RESOURCE_EXHAUSTED")
    max_prompt_chars: int = opt(1_000_000, "characters per text prompt or chat conversation (all its messages)")
    max_chat_messages: int = opt(1024, "messages in one chat conversation")
    log_level: str = opt("info", "debug | info | warning | error")
    log_requests: bool = opt(False, "put prompts and outputs in the logs")
    # -- disaggregated prefill and decode (docs/disaggregation.md) --
    role: str = opt("both", "both | prefill | decode")
    prefill_target: str | None = opt(None, 'decode: the prefill instance, "unix:PATH" or "HOST:PORT"')
    prefill_fallback: str = opt("local", "decode, when the target is down or late: local | fail")
    prefill_timeout: float = opt(60.0, "decode: seconds a remote prefill (compute + transfer) may take")
    kv_transport: str = opt("auto", "decode: auto (shared memory on one host, else gRPC) | shm | grpc")
    kv_test_fault: str | None = opt(None, "prefill, testing only: corrupt | cut | delay:SECONDS")
    # -- tenants (docs/tenants.md) --
    tenants: str | None = opt(None, "tenants.toml: callers by socket uid/gid or HTTP key, weights, quotas, admins")
    scheduling_policy: str = opt("fcfs", "fcfs | priority (the request's priority, lower first) | fair (per tenant)")
    # -- LoRA adapters (docs/lora.md; vLLM's flags) --
    enable_lora: bool = opt(False, "serve LoRA adapters per request (the OpenAI model field, gRPC lora_name)")
    lora_modules: str | None = opt(None, 'adapters loaded at start: "name=path ..." (PEFT directories)')
    max_loras: int = opt(1, "adapters one step can run (execution slots)")
    max_lora_rank: int = opt(16, "the largest adapter rank served (the slots are sized for it)")
    max_cpu_loras: int | None = opt(None, "adapters kept read in host memory (LRU); unset = max_loras")
    allow_runtime_lora_updating: bool = opt(False, "load/unload adapters at run time (Admin RPCs, HTTP routes)")
    # -- KV cache dtype (cupy_kernels/kv_layout.py) --
    kv_cache_dtype: str = opt("auto", "KV pool values: auto | float32 | bfloat16 | float16 | int8 | fp8_e4m3 | "
                              "fp8_e5m2 (auto: float32 on CPU, float16 on GPU)")

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
        elif method == "suffix":
            config.update({k: getattr(self, k) for k in ("suffix_decoding_max_tree_depth",
                                                        "suffix_decoding_max_cached_requests",
                                                        "suffix_decoding_max_spec_factor",
                                                        "suffix_decoding_min_token_prob")})
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
        parse_lora_modules(self.lora_modules)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")

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


def parse_lora_modules(text: str | None) -> dict[str, str]:
    """'a=/path/a b=/path/b' (spaces or commas) -> {name: path}; ValueError naming the bad entry."""
    modules: dict[str, str] = {}
    for entry in (text or "").replace(",", " ").split():
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: each entry must be name=path, got {entry!r}")
        if name in modules:
            raise ValueError(f"lora_modules: adapter name {name!r} is given twice")
        modules[name] = path
    return modules


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
        # argparse formats help with %: a literal one is doubled.
        help_default = f"{f.metadata['help']} [env {ENV_PREFIX}{f.name.upper()}; default {f.default!r}]".replace(
            "%", "%%")
        if typ is bool:
            parser.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                                help=help_default)
        elif f.name == "lora_modules":  # vLLM's --lora-modules a=PATH b=PATH
            parser.add_argument(flag, dest=f.name, default=None, type=str, nargs="+", help=help_default)
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
        if isinstance(flag, list):
            flag = " ".join(flag)
        if flag is not None:
            values[f.name] = flag if isinstance(flag, bool) else _parse(flag, typ, "--" + f.name.replace("_", "-"))
    settings = Settings(**values)
    settings.validate()
    return settings
