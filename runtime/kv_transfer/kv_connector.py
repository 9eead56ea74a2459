"""The KV connector: how a request's KV blocks move between a prefill and a decode instance.

Disaggregated serving splits a request's life across two engines::

    app --Generate--> decode instance                         prefill instance
                      prompt: 100 tokens, block_size 16
                      local prefix hit: blocks 0..1
                      allocate blocks 2..5 (destination) --> compute tokens 0..95 (6 full blocks)
                      request WAITING_FOR_REMOTE_KVS          read blocks 2..5 out of its pool,
                      ...other streams keep decoding...  <--  send them (shared memory or gRPC)
                      write them into blocks 2..5             free its blocks
                      register them in the prefix cache
                      compute tokens 96..99 (the tail), sample, decode

Only *full* blocks that end before the prompt's last token travel: they are immutable and
content-addressed (prefix-cache hashes), so each side can keep and share them, and a prompt whose
prefix the decode side already holds transfers only the missing blocks. The decode side computes the
tail (1..block_size tokens) itself; its forward gives the logits of the first token, so sampling
(greedy, seeded, n > 1, logprobs) runs exactly as on a colocated ``both`` instance.

The interface has two halves, as vLLM's KVConnectorBase_V1 has a scheduler side and a worker side:

- ``KVConnector`` (the decode side's receiver): ``start_load(spec)`` with the destination block ids
  already allocated, ``get_finished()`` polled by the engine each step, ``abort(request_id)``.
  A transport fills the destination however it can: here a staging buffer the engine copies from
  (``KVLoadResult.data``); a CUDA IPC or NIXL transport would read straight into the destination
  blocks (their ids are in the spec) and hand back ``data=None``.
- ``KVExport`` (the prefill side's sender hook): the engine calls its ``sink`` in the step that
  completes the prompt, while the request still holds its blocks, with a ``KVBlockIO`` and the block
  ids to send. A sink that copies (shared memory, gRPC) returns at once and the blocks are freed as
  usual; a zero-copy one (NIXL) would keep a reference until the remote read is done.

This module knows nothing of gRPC; the transports live in ``kv_shm.py`` (same host) and in the
sidecar (gRPC streaming).
"""

from __future__ import annotations

import hashlib
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from pagedserve.cupy_kernels.backend import to_host
from pagedserve.cupy_kernels.kv_layout import kv_cache_layout

CHUNK_BYTES = 4 << 20  # payloads are checksummed (and sent over gRPC) in chunks of at most this
ROLES = ("both", "prefill", "decode")


class KVTransferError(Exception):
    """A remote prefill failed and the request cannot be served (``--prefill-fallback fail``)."""


class KVHandshakeError(ValueError):
    """The two instances cannot exchange KV blocks (model, block size, dtype or roles differ)."""


@dataclass(frozen=True)
class KVTransferSpec:
    """What each side tells the other at the handshake; blocks only move between equal layouts."""

    role: str
    model_name: str
    model_fingerprint: str
    block_size: int
    dtype: str  # the KV pool's kv_cache_dtype ("float32", "bfloat16", "float16"; cupy_kernels/kv_layout.py)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    host_id: str = ""

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block on the wire: every layer's K and V, [layers, 2, block_size, kv_heads, head_dim]."""
        row = kv_cache_layout(self.dtype, np.float32).row_elements(self.head_dim)  # int8: the row's scale too
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, row)

    @property
    def storage(self) -> np.dtype:
        """The numpy dtype of a block's values on the wire: the pool's own (bfloat16: its uint16 bits)."""
        return kv_cache_layout(self.dtype, np.float32).storage

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * self.storage.itemsize


def check_compatible(local: KVTransferSpec, remote: KVTransferSpec, target: str) -> None:
    """Raise KVHandshakeError naming the first difference that would make the blocks wrong."""
    if remote.role == "decode":
        raise KVHandshakeError(f"prefill target {target} is itself a decode instance (role 'decode'); point "
                               f"--prefill-target at an instance started with --role prefill or both")
    if local.dtype != remote.dtype:
        raise KVHandshakeError(f"prefill target {target} keeps its KV cache in {remote.dtype} (kv_cache_dtype) and "
                               f"this instance in {local.dtype}; blocks cannot move between them: start both with "
                               f"the same --kv-cache-dtype")
    for name in ("model_name", "model_fingerprint", "block_size", "num_layers", "num_kv_heads", "head_dim"):
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            raise KVHandshakeError(f"prefill target {target} does not match this instance: {name} is {b!r} there "
                                   f"and {a!r} here; both instances must serve the same model with the same "
                                   f"block size and dtype")
    if remote.max_model_len < local.max_model_len:
        raise KVHandshakeError(f"prefill target {target} accepts sequences of up to {remote.max_model_len} tokens, "
                               f"this instance up to {local.max_model_len}; give the prefill instance a "
                               f"--max-model-len at least as large")


def transfer_spec(role: str, host_id: str, model_name: str, model_config: Any, embed_tokens: Any, block_size: int,
                  dtype: str, max_model_len: int) -> KVTransferSpec:
    """What a handshake tells the other instance about this one."""
    c = model_config
    fingerprint = model_fingerprint(model_name, c, to_host(embed_tokens[:4]))
    return KVTransferSpec(role, model_name, fingerprint, block_size, dtype, c.num_hidden_layers, c.num_key_value_heads,
                          c.head_dim, max_model_len, host_id)


def model_fingerprint(model_name: str, model_config: Any, embed_rows: np.ndarray) -> str:
    """Identity of the weights, cheap to compute: config facts plus a hash of a few embedding rows."""
    h = hashlib.sha256(repr((model_name, model_config.architecture, model_config.num_hidden_layers,
                             model_config.num_key_value_heads, model_config.head_dim,
                             model_config.vocab_size, model_config.hidden_size)).encode())
    h.update(np.ascontiguousarray(embed_rows, dtype=np.float32).tobytes())
    return h.hexdigest()[:16]


def chunk_checksums(buf: memoryview | bytes, chunk_bytes: int = CHUNK_BYTES) -> list[int]:
    """crc32 of each consecutive chunk of at most chunk_bytes."""
    view = memoryview(buf).cast("B")
    return [zlib.crc32(view[i : i + chunk_bytes]) for i in range(0, len(view), chunk_bytes)]


class KVBlockIO:
    """Reads and writes whole blocks of the engine's pool in the wire layout (see KVTransferSpec).

    The per-layer caches are [num_blocks, block_size, kv_heads, head_dim]; on the wire a block is all
    layers' K and V together, so the blocks of one request form one contiguous array
    [n, layers, 2, block_size, kv_heads, head_dim] that can be checksummed and sent in chunks.
    """

    def __init__(self, kv_caches: list[tuple[Any, Any]], backend: Any) -> None:
        self.kv_caches = kv_caches
        self.backend = backend

    def read_into(self, block_ids: list[int], out: np.ndarray) -> None:
        idx = np.asarray(block_ids, dtype=np.int64)
        for layer, (k, v) in enumerate(self.kv_caches):
            out[:, layer, 0] = to_host(k[idx])
            out[:, layer, 1] = to_host(v[idx])

    def write(self, block_ids: list[int], data: np.ndarray) -> None:
        idx = np.asarray(block_ids, dtype=np.int64)
        for layer, (k, v) in enumerate(self.kv_caches):
            k[idx] = self.backend.asarray(data[:, layer, 0])
            v[idx] = self.backend.asarray(data[:, layer, 1])


# -- the decode side (receiver) ------------------------------------------------------------------------


@dataclass
class KVLoadSpec:
    """Blocks [first_block, num_blocks) of `token_ids` go into dst_block_ids of the local pool."""

    request_id: str
    token_ids: list[int]  # exactly num_blocks * block_size tokens: the prompt's full blocks
    cache_salt: str | None
    first_block: int  # blocks below this are already here (local prefix-cache hit) and are not sent
    dst_block_ids: list[int]
    lora_name: str | None = None  # the LoRA adapter the blocks are computed with (None: the base model)

    @property
    def num_blocks(self) -> int:
        return self.first_block + len(self.dst_block_ids)


@dataclass
class KVLoadResult:
    request_id: str
    data: np.ndarray | None = None  # [len(dst_block_ids), *block_shape]; None when already in place
    error: str | None = None
    broken: bool = False  # data arrived but was cut or corrupt (vs. the target being down or late)
    num_bytes: int = 0
    transfer_s: float = 0.0  # sender's copy-out + the wire + checks (not the remote prefill's compute)
    transport: str = ""
    release: Callable[[], None] = lambda: None  # frees the staging buffer (unlinks a shared segment)

    @property
    def ok(self) -> bool:
        return self.error is None


class KVConnector:
    """The decode side of a transport. Methods are called from the engine's worker thread."""

    transport_name = "none"

    def __init__(self) -> None:
        self._finished: list[KVLoadResult] = []
        self._lock = threading.Lock()
        self._progress = threading.Event()

    def start_load(self, spec: KVLoadSpec) -> None:
        """Begin fetching; must not block the step loop. The outcome comes back through get_finished."""
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """The request is gone: stop its transfer (the remote frees its blocks); its result is dropped."""

    def close(self) -> None:
        pass

    # Transports call this from their own threads.
    def _deliver(self, result: KVLoadResult) -> None:
        with self._lock:
            self._finished.append(result)
        self._progress.set()

    def get_finished(self) -> list[KVLoadResult]:
        with self._lock:
            done, self._finished = self._finished, []
            self._progress.clear()
        return done

    def wait(self, timeout: float) -> None:
        """Block until a transfer finishes or `timeout` passes (the engine has nothing else to do)."""
        self._progress.wait(timeout)


# -- the prefill side (sender) -------------------------------------------------------------------------


@dataclass
class KVExport:
    """Attached to a prefill-only request: send blocks [first_block, ...) once the prompt is computed."""

    first_block: int
    sink: Callable[[KVBlockIO, list[int]], Any]  # runs in the worker thread while the blocks are held
    result: Any = None
    error: str | None = None
    export_s: float = 0.0
    num_blocks: int = 0


@dataclass
class KVTransferStats:
    """Counters since start; both roles keep them (a `both` instance may act as a prefill target)."""

    kv_blocks_sent: int = 0
    kv_blocks_received: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    kv_transfer_s: float = 0.0  # summed over received requests
    remote_prefills: int = 0  # requests whose blocks arrived from a prefill instance
    local_prefill_fallbacks: int = 0  # requests meant for remote prefill that were prefilled here
    fallback_reasons: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> "KVTransferStats":
        return KVTransferStats(**{**self.__dict__, "fallback_reasons": dict(self.fallback_reasons)})
