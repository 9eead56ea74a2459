"""Decode steps replayed from CUDA graphs: one captured forward per (batch size, context bucket), replayed with
new metadata.

A decode step of a small model is launch-bound: ~15 kernels per layer, each a few microseconds of
Python and driver work. Capturing the whole forward once and replaying it costs one graph launch per
step instead.

    decode step, B sequences (one token each), longest needing n blocks
        -> padded_size(B): the smallest captured size >= B (else: eager forward)
        -> context bucket: the narrowest captured table width W >= n (else: eager forward)
        -> pack_decode_batch: the real rows, then padding rows (token 0, position 0, slot -1 = no KV
           write, seq_len 1 reading block 0), block tables W columns wide
        -> two host->device copies of exactly those bytes, from pinned memory, into the shared static
           buffers (their first 4B int64 and 2B+1+B*W int32 elements)
        -> graph launch on the current stream; logits rows [:B] of the shared static output

Context buckets. The attention kernel launches ceil(W * block_size / PARTITION_SIZE) partitions per
(query tile, kv head), sized from the table width. A single width of max_model_len would launch, at
131,072 tokens and batch 256, 256 partitions - about half a million mostly idle CTAs per layer for
a batch of short sequences - and copy an 8 MiB table every step. So widths come in buckets of
1, 2, 4, ... partitions up to max_model_len: a step launches at most twice the partitions its longest
sequence needs, and uploads only its bucket's width.

Capture itself (a private stream, the graphs' memory arena, pinned uploads) is behind GraphCapturer:
cuda_graphs.CupyGraphCapturer on a GPU, a fake in the unit tests. cuda_graphs.py also says what capture needs
and how it is met.

KV cache groups (a model with sliding-window layers, runtime/core/kv_cache_groups.py): the tables and slots of
every group after the first go up too, into static buffers of their own (padding rows: slot -1, block 0), and
the captured batch's layers read their group's views of them (ForwardBatch.kv_tables).

Activations. The captured forward allocates nothing: every op writes into one Workspace (models/workspace.py)
that all graphs share, sized by one eager forward of the largest size and width before the warm-ups (so its
buffers come from the ordinary pool, not the warm-ups' throw-away one) and frozen; the float32 logits are its
`logits` buffer, the shared static output. A family whose forward still allocates (LoRA, Gemma 3's GELU) draws
from the graphs' private pool as before (cuda_graphs.py).

LoRA (a model with adapter slots, models/lora.py): each row's adapter slot goes up too, into a static int32 buffer
(padding and base rows: -1) that the captured LoRA kernels read, as they read the block tables; the slots'
A, B and scales are the model's persistent device arrays, written in place when an adapter takes a slot (before
the step, worker.execute_model), so a replay serves whatever adapters the step's rows name. A step without
adapter rows replays the same graphs (every row -1: the LoRA kernels' CTAs return at once).

Failure policy: a capture error (any exception while warming up, capturing, or in the first test
launch) is logged as `cuda_graphs.capture_failed` with the batch size and the error, every graph is
dropped, and decode steps run eagerly. A failure of a later replay is raised, not hidden.
"""

from __future__ import annotations

import bisect
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from pagedserve.cupy_kernels.cuda.ops import PARTITION_SIZE
from pagedserve.models.batch import ForwardBatch
from pagedserve.models.device_batch import PackedLayout, blocks_needed, check_batch, unpack_batch
from pagedserve.models.workspace import Workspace, takes_workspace

from ..config import EngineConfig

try:
    import structlog

    log = structlog.get_logger("pagedserve.engine")
except ImportError:  # the bare GPU check machine may have numpy and CuPy only
    import logging

    class _KeyValueLogger:
        def __init__(self, logger: logging.Logger) -> None:
            self._logger = logger

        def _emit(self, level: int, event: str, **kw: Any) -> None:
            self._logger.log(level, "%s %s", event, " ".join(f"{k}={v!r}" for k, v in kw.items()))

        def info(self, event: str, **kw: Any) -> None:
            self._emit(logging.INFO, event, **kw)

        def warning(self, event: str, **kw: Any) -> None:
            self._emit(logging.WARNING, event, **kw)

    log = _KeyValueLogger(logging.getLogger("pagedserve.engine"))

# Sizes captured by default (those <= max_num_seqs, plus max_num_seqs itself when it is smaller
# than the largest). Dense at the small end where most decode batches of a lightly loaded server
# are; padding wastes at most a third of a step above 64.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def default_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    sizes = [s for s in DEFAULT_BATCH_SIZES if s <= max_num_seqs]
    if max_num_seqs < DEFAULT_BATCH_SIZES[-1] and max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return tuple(sizes)


def resolve_batch_sizes(config: EngineConfig) -> tuple[int, ...]:
    """The sizes to capture: the configured ones (validated by EngineConfig) or the defaults, up to
    the most sequences a decode step can hold (max_num_seqs, and one token each within the budget)."""
    if config.cuda_graph_batch_sizes is not None:
        return tuple(config.cuda_graph_batch_sizes)
    return default_batch_sizes(min(config.max_num_seqs, config.max_num_batched_tokens))


def padded_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the sorted `sizes` that holds `num_seqs` rows; None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) and num_seqs > 0 else None


def is_decode_step(batch: ForwardBatch) -> bool:
    """Every sequence has exactly one new token and wants its logits, in row order (host metadata).

    Graphs are captured for that shape only: a prefill chunk, or a speculative verify step (a decode
    scheduled as 1 + k tokens with 1 + k logits rows), runs eagerly.
    """
    b = batch.num_seqs
    li = np.asarray(batch.logits_indices)
    qsl = np.asarray(batch.query_start_loc)
    return (batch.num_tokens == b and li.shape == (b,) and bool((li == np.arange(b)).all())
            and bool((np.diff(qsl) == 1).all()))


def context_buckets(max_blocks: int, block_size: int) -> tuple[int, ...]:
    """Block-table widths captured: 1, 2, 4, ... attention partitions' worth of blocks, the last one
    max_blocks (ceil(max_model_len / block_size))."""
    per_partition = max(1, PARTITION_SIZE // block_size)
    widths, parts = [], 1
    while True:
        width = min(max_blocks, parts * per_partition)
        widths.append(width)
        if width >= max_blocks:
            return tuple(widths)
        parts *= 2


def pack_decode_batch(batch: ForwardBatch | None, size: int,
                      max_blocks: int) -> tuple[np.ndarray, np.ndarray, PackedLayout]:
    """Host buffers (see device_batch.pack_batch) for a decode batch padded to `size` rows.

    batch=None gives padding rows only (what the static buffers hold while capturing). Padding rows
    write no KV (slot -1) and attend to one key in block 0, so they can neither fault nor disturb a
    real row: every op of the forward is row-independent.
    """
    layout = PackedLayout(size, size, size, max_blocks)
    b = 0 if batch is None else batch.num_seqs
    if b > size:
        raise ValueError(f"a decode batch of {b} sequences does not fit a captured size of {size}")
    i64 = np.zeros(layout.i64_size, dtype=np.int64)
    i64[2 * size : 3 * size] = -1
    i64[3 * size :] = np.arange(size)
    i32 = np.zeros(layout.i32_size, dtype=np.int32)
    i32[: size + 1] = np.arange(size + 1)  # one query token per row
    i32[size + 1 : 2 * size + 1] = 1
    if batch is not None:
        i64[:b] = batch.input_ids
        i64[size : size + b] = batch.positions
        i64[2 * size : 2 * size + b] = batch.slot_mapping
        i32[size + 1 : size + 1 + b] = batch.seq_lens
        tables = np.asarray(batch.block_tables)
        width = min(max_blocks, tables.shape[1])
        i32[2 * size + 1 :].reshape(size, max_blocks)[:b, :width] = tables[:, :width]
    return i64, i32, layout


def pack_decode_groups(batch: ForwardBatch | None, size: int, max_blocks: int,
                       num_extra: int) -> tuple[np.ndarray, np.ndarray]:
    """The slots [num_extra * size] int64 and block tables [num_extra * size * max_blocks] int32 of the KV
    cache groups after the first, padded like pack_decode_batch (slot -1, block 0)."""
    slots = np.full((num_extra, size), -1, dtype=np.int64)
    tables = np.zeros((num_extra, size, max_blocks), dtype=np.int32)
    if batch is not None:
        b = batch.num_seqs
        for g in range(num_extra):
            slots[g, :b] = batch.group_slot_mappings[g]
            src = np.asarray(batch.group_block_tables[g])
            width = min(max_blocks, src.shape[1])
            tables[g, :b, :width] = src[:, :width]
    return slots.reshape(-1), tables.reshape(-1)


class GraphCapturer(Protocol):
    """The CUDA side of capturing (cuda_graphs.CupyGraphCapturer), kept behind a small interface so
    DecodeGraphs runs on numpy in the unit tests (with a fake that records the function and "replays" it by
    calling it)."""

    def warmup(self, fn: Callable[[], None]) -> None: ...

    def reserve(self) -> None: ...

    def capture(self, fn: Callable[[], None]) -> Any: ...

    def upload(self, copies: Sequence[tuple[Any, np.ndarray]]) -> None: ...

    def launch(self, graph: Any) -> None: ...

    def synchronize(self) -> None: ...

    def pool_bytes(self) -> int: ...

    def release(self) -> None: ...


@dataclass
class _Captured:
    size: int
    width: int  # block table columns
    batch: ForwardBatch  # views into the shared static buffers
    graph: Any = None


@dataclass
class DecodeGraphs:
    """Captured decode forwards by (padded batch size, table width); `run` replays one or returns None."""

    model: Any  # the registry's model class for the config (models/registry.py)
    kv_caches: list[tuple[Any, Any]]
    sizes: tuple[int, ...]
    max_blocks: int  # widest block table: ceil(max_model_len / block_size)
    capturer: GraphCapturer
    layer_group: tuple[int, ...] = ()  # each layer's KV cache group (empty: one group)
    captured: dict[tuple[int, int], _Captured] = field(default_factory=dict)
    num_replays: int = 0
    disabled_reason: str | None = None
    capture_seconds: float = 0.0
    upload_bytes: int = 0  # host->device bytes of the last replay's metadata

    def __post_init__(self) -> None:
        self.sizes = tuple(sorted(set(self.sizes)))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"CUDA graph batch sizes must be positive integers, got {self.sizes}")
        k_cache = self.kv_caches[0][0]
        self.block_size, self.num_blocks = int(k_cache.shape[1]), int(k_cache.shape[0])
        self.widths = context_buckets(self.max_blocks, self.block_size)
        self.vocab_size = self.model.config.vocab_size
        xp = self.model.backend.xp
        # The ops' buffers (the CUDA set's: the numpy and numba ones take no out=); its logits, the static output.
        self.workspace = Workspace(xp) if takes_workspace(self.model.backend) else None
        if self.workspace is not None:
            self.logits = self.workspace.take("logits", (self.sizes[-1], self.vocab_size), np.float32)
        else:
            self.logits = xp.empty((self.sizes[-1], self.vocab_size), dtype=np.float32)  # shared static output
        largest = PackedLayout(self.sizes[-1], self.sizes[-1], self.sizes[-1], self.max_blocks)
        self.static_i64 = xp.zeros(largest.i64_size, dtype=np.int64)
        self.static_i32 = xp.zeros(largest.i32_size, dtype=np.int32)
        self.layer_group = tuple(self.layer_group)
        self.num_extra = max(self.layer_group, default=0)  # KV cache groups after the first
        self.static_slots = xp.zeros(max(1, self.num_extra * self.sizes[-1]), dtype=np.int64)
        self.static_tables = xp.zeros(max(1, self.num_extra * self.sizes[-1] * self.max_blocks), dtype=np.int32)
        lora = getattr(self.model, "lora", None)  # the adapters' slots (models/lora.py), None without enable_lora
        self.max_loras = None if lora is None else lora.max_loras
        self.static_lora = None if lora is None else xp.asarray(np.full(self.sizes[-1], -1, dtype=np.int32))

    @property
    def enabled(self) -> bool:
        return bool(self.captured)

    def _step(self, size: int, width: int) -> _Captured:
        layout = PackedLayout(size, size, size, width)
        i64, i32 = self.static_i64[: layout.i64_size], self.static_i32[: layout.i32_size]
        batch = replace(unpack_batch(i64, i32, layout), workspace=self.workspace)
        if self.num_extra:
            n = self.num_extra
            slots = self.static_slots[: n * size].reshape(n, size)
            tables = self.static_tables[: n * size * width].reshape(n, size, width)
            batch = replace(batch, group_slot_mappings=tuple(slots[g] for g in range(n)),
                            group_block_tables=tuple(tables[g] for g in range(n)), layer_group=self.layer_group)
        if self.static_lora is not None:
            batch = replace(batch, lora_slots=self.static_lora[:size])
        return _Captured(size, width, batch)

    def _padding(self, size: int, width: int) -> list[tuple[Any, np.ndarray]]:
        """(static view, host array) pairs of a graph's padding-only batch."""
        return self._copies(None, size, width)

    def _copies(self, batch: ForwardBatch | None, size: int, width: int) -> list[tuple[Any, np.ndarray]]:
        """(static view, host array) pairs of `batch` (None: padding only) packed for a graph of (size, width)."""
        host_i64, host_i32, _ = pack_decode_batch(batch, size, width)
        copies = [(self.static_i64[: host_i64.size], host_i64), (self.static_i32[: host_i32.size], host_i32)]
        if self.num_extra:
            slots, tables = pack_decode_groups(batch, size, width, self.num_extra)
            copies += [(self.static_slots[: slots.size], slots), (self.static_tables[: tables.size], tables)]
        if self.static_lora is not None:
            lora = np.full(size, -1, dtype=np.int32)
            if batch is not None and batch.lora_slots is not None:
                lora[: batch.num_seqs] = batch.lora_slots
            copies.append((self.static_lora[:size], lora))
        return copies

    def _upload(self, copies: list[tuple[Any, np.ndarray]]) -> None:
        self.capturer.upload(copies)
        self.upload_bytes = sum(src.nbytes for _, src in copies)

    def capture_all(self) -> bool:
        """Warm up every (size, width), largest first; reserve the graph memory they measured; capture
        them in the same order. On any error drop them all. True if all were captured."""
        t0 = time.perf_counter()
        order = [(size, width) for size in reversed(self.sizes) for width in reversed(self.widths)]
        steps = {key: self._step(*key) for key in order}
        phases = ("warmup", "capture") if self.workspace is None else ("size", "warmup", "capture")
        for phase in phases:
            for size, width in order[:1] if phase == "size" else order:
                error = None
                step = steps[(size, width)]
                try:
                    # The static buffers hold this graph's padding rows whenever it runs here (they are
                    # shared: another graph's layout would put real slot ids where this one reads).
                    self._upload(self._padding(size, width))
                    fn = self._forward_fn(step)
                    if phase == "size":  # eager, outside the capturer's pools: the workspace's buffers, then frozen
                        fn()
                        self.workspace.frozen = True
                    elif phase == "warmup":
                        self.capturer.warmup(fn)
                    else:
                        step.graph = self.capturer.capture(fn)
                        self.capturer.launch(step.graph)  # a test replay: a bad graph fails here, at start-up
                        self.capturer.synchronize()
                    if phase == "warmup" and (size, width) == order[-1]:
                        self.capturer.reserve()  # all warm-ups measured: the arena, before any capture
                except Exception as e:  # noqa: BLE001 - every capture error means: run eagerly
                    error, trace = f"{type(e).__name__}: {e}", traceback.format_exc(limit=8)
                if error is not None:  # outside the except: the traceback's arrays are gone before the release
                    self.disable(f"{phase} of batch size {size} (table width {width}) failed: {error}")
                    log.warning("cuda_graphs.capture_failed", batch_size=size, table_width=width, phase=phase,
                                error=error, traceback=trace, fallback="eager")
                    return False
                if phase == "capture":
                    self.captured[(size, width)] = step
        self.capture_seconds = time.perf_counter() - t0
        log.info("cuda_graphs.captured", batch_sizes=list(self.sizes), table_widths=list(self.widths),
                 num_graphs=len(self.captured), seconds=round(self.capture_seconds, 3),
                 pool_bytes=self.capturer.pool_bytes())
        return True

    def _forward_fn(self, step: _Captured) -> Callable[[], None]:
        def forward() -> None:
            out = self.model.forward(step.batch, self.kv_caches)
            if _address(out) != _address(self.logits) or out.shape[0] != step.size:
                self.logits[: step.size] = out  # a forward that did not write the workspace's logits (a copy)

        return forward

    def disable(self, reason: str) -> None:
        """Drop every graph (and their memory) and run eagerly from now on."""
        self.captured.clear()
        self.disabled_reason = reason
        self.workspace = None  # its buffers go with the last step that held them
        try:  # nothing may still run from the pool about to be freed
            self.capturer.synchronize()
        except Exception:  # noqa: BLE001 - a sticky device error surfaces again at the next eager step
            pass
        self.capturer.release()

    def run(self, batch: ForwardBatch) -> Any | None:
        """Logits [B, V] for a decode step from a graph replay, or None when the step must run eagerly
        (graphs off, a prefill chunk in the batch, more sequences than the largest captured size, or a
        sequence longer than the graphs were captured for). The returned array is a view of the
        shared static output: valid until the next `run`."""
        if not self.captured or not is_decode_step(batch):
            return None
        size = padded_size(batch.num_seqs, self.sizes)
        width = padded_size(blocks_needed(np.asarray(batch.seq_lens), self.block_size), self.widths)
        if size is None or width is None:
            return None
        check_batch(batch, self.block_size, self.num_blocks, self.vocab_size)
        if batch.lora_slots is not None:
            lora = np.asarray(batch.lora_slots)
            if self.max_loras is None or lora.shape != (batch.num_seqs,) or not (
                    (lora >= -1) & (lora < self.max_loras)).all():
                raise ValueError(f"a decode batch's lora_slots {lora.tolist()} for graphs captured with "
                                 f"{self.max_loras or 0} LoRA slots")
        if len(batch.group_block_tables) != self.num_extra:
            raise ValueError(f"a decode batch of {1 + len(batch.group_block_tables)} KV cache groups for graphs "
                             f"captured with {1 + self.num_extra}")
        for tables, slots in zip(batch.group_block_tables, batch.group_slot_mappings):
            check_batch(replace(batch, block_tables=tables, slot_mapping=slots, group_block_tables=(),
                                group_slot_mappings=()), self.block_size, self.num_blocks)
        step = self.captured[(size, width)]
        self._upload(self._copies(batch, size, width))
        self.capturer.launch(step.graph)
        self.num_replays += 1
        return self.logits[: batch.num_seqs]


def _address(a: Any) -> int:
    """Where an array's first element is (CuPy: its device pointer; numpy: its host address)."""
    data = a.data
    return int(data.ptr) if hasattr(data, "ptr") else int(a.__array_interface__["data"][0])
