"""CUDA graphs for decode steps: the CUDA side of capturing them, and building them for an engine.

Which graphs there are, how a decode step is padded into one and replayed: decode_graphs.py (DecodeGraphs,
re-exported here with the rest of its public names). Here: CupyGraphCapturer (stream capture with CuPy, over a
private memory pool drawing from a reserved arena), and build_decode_graphs.

What capture needs, and how it is met:
- No host<->device synchronisation inside the forward. With metadata on the device (the static
  buffers) and inv_freq on the device, the op layer reads nothing back; the first eager run of each
  graph (the warm-up) compiles every kernel and initialises cuBLAS before the capture starts.
- Shapes and pointers fixed at capture. Every graph reads views of one pair of static buffers sized
  for the largest size and width (replays are serialised on one stream, so they can share them);
  the KV caches and weights are allocated once and never move.
- Memory. CuPy's MemoryPool is not capture-aware (cupy/cuda/memory.pyx: arenas per stream, no
  notion of a graph): an array allocated and freed during capture goes back to the free list, and a
  later eager allocation on the same stream could take it while a graph still writes there on
  replay. So captures (and their warm-ups) allocate from a private MemoryPool, through
  `cupy.cuda.using_allocator`, that nothing else uses; graphs are captured largest first, so smaller
  ones reuse the larger ones' blocks, and replays, serialised on one stream, share them safely.
  When a pool cannot get memory it frees every cached block and retries
  (SingleDeviceMemoryPool._try_malloc) - blocks earlier graphs still point into - and the driver
  would then hand that same memory out again, to this pool or to anyone. Hence the private pool
  draws from an arena reserved before the first capture (`ArenaAllocator`): one cudaMalloc of the
  measured need (the warm-ups of every graph, run first under a throw-away pool that caches and
  reuses like the private one will, plus a margin) that the arena only ever hands out forwards. A
  block the pool lets go is never handed out again, so a retry cannot alias a graph's memory; it
  gets fresh arena bytes or fails, and a failure drops every graph (decode_graphs.py's failure
  policy). gpu_memory.py counts the same reservation against the KV cache.
- The ops allocate their outputs (cupy.empty) inside the forward, which the private pool covers;
  no `out=` parameters are needed in the op layer.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Sequence

import numpy as np

from pagedserve.models.device_batch import PinnedStaging

from ..config import EngineConfig
# The decode side, whose names callers import from here.
from .decode_graphs import (DEFAULT_BATCH_SIZES, DecodeGraphs, GraphCapturer, context_buckets,  # noqa: F401
                            default_batch_sizes, is_decode_step, log, pack_decode_batch, padded_size,
                            resolve_batch_sizes)

GRAPH_POOL_MARGIN = 0.25  # the arena holds the measured peak plus this fraction ...
GRAPH_POOL_SLACK_BYTES = 8 << 20  # ... plus this (pool rounding, splits that cannot be reused)


def graph_pool_reserve(measured_bytes: int) -> int:
    """Bytes reserved for the graphs' private pool, from the measured growth of a pool over warm-ups."""
    return int(measured_bytes * (1 + GRAPH_POOL_MARGIN)) + GRAPH_POOL_SLACK_BYTES


class ArenaExhausted(MemoryError):
    pass


class ArenaAllocator:
    """Hands out aligned slices of one reserved allocation, forwards only; `free` gives nothing back.

    The private graph pool allocates through this, so memory it ever held stays out of every other
    allocation until the graphs are released - even after the pool dropped it in an out-of-memory
    retry. Plain integers, so the rule is tested without a GPU.
    """

    ALIGNMENT = 512  # CuPy's pool rounds to 512 bytes as well

    def __init__(self, base: int, capacity: int) -> None:
        self.base = base
        self.capacity = capacity
        self.used = 0
        self.num_allocations = 0

    def allocate(self, size: int) -> int:
        """Address of `size` fresh bytes; ArenaExhausted when they do not fit."""
        start = -(-self.used // self.ALIGNMENT) * self.ALIGNMENT
        if size < 0 or start + size > self.capacity:
            raise ArenaExhausted(f"CUDA graph memory arena: {size} bytes requested, "
                                 f"{max(0, self.capacity - start)} of {self.capacity} left")
        self.used = start + size
        self.num_allocations += 1
        return self.base + start


class CupyGraphCapturer:
    """Stream capture with CuPy: a private non-blocking stream and a private memory pool over a
    reserved arena; host->device uploads staged in pinned memory."""

    def __init__(self) -> None:
        import cupy

        self._cp = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pool = None
        self.arena = None
        self._arena_memory = None
        self._probe = None  # the warm-ups' throw-away pool, until reserve()
        self._staging: PinnedStaging | None = None

    def warmup(self, fn: Callable[[], None]) -> None:
        """Run fn once eagerly on the capture stream (kernels compiled, cuBLAS initialised) under the
        probe pool, whose growth over all warm-ups measures what the captures will need."""
        cp = self._cp
        if self._probe is None:
            self._probe = cp.cuda.MemoryPool()
        # The capture stream does not synchronise with the legacy default stream by itself.
        self.stream.wait_event(cp.cuda.get_current_stream().record())
        with cp.cuda.using_allocator(self._probe.malloc), self.stream:
            fn()
        self.stream.synchronize()

    def reserve(self) -> None:
        """Reserve the arena for the private pool: the probe pool's size after the warm-ups, plus a margin."""
        cp = self._cp
        measured = int(self._probe.total_bytes()) if self._probe is not None else 0
        if self._probe is not None:
            self._probe.free_all_blocks()
            self._probe = None
        capacity = graph_pool_reserve(measured)
        self._arena_memory = cp.cuda.Memory(capacity)  # its own cudaMalloc: no pool can free it
        self.arena = ArenaAllocator(int(self._arena_memory.ptr), capacity)
        self.pool = cp.cuda.MemoryPool(allocator=self._arena_malloc)

    def _arena_malloc(self, size: int):
        cp = self._cp
        try:
            address = self.arena.allocate(size)
        except ArenaExhausted as e:  # not a CUDA OOM: the pool raises it as it is, without a retry
            raise MemoryError(str(e)) from None
        return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(address, size, self._arena_memory), 0)

    def _allocator(self):
        if self.pool is None:  # reserve() was not called: a plain private pool
            self.pool = self._cp.cuda.MemoryPool()
        return self.pool.malloc

    def capture(self, fn: Callable[[], None]) -> Any:
        cp = self._cp
        with cp.cuda.using_allocator(self._allocator()), self.stream:
            self.stream.begin_capture()
            try:
                fn()
            except BaseException:
                try:  # end the capture so the stream is usable again; the graph is discarded
                    self.stream.end_capture()
                except Exception:
                    pass
                raise
            return self.stream.end_capture()

    def upload(self, copies: Sequence[tuple[Any, np.ndarray]]) -> None:
        """Copy host arrays into the static device buffers on the current stream, asynchronously,
        from pinned memory (models/device_batch.PinnedStaging)."""
        if self._staging is None:
            self._staging = PinnedStaging(self._cp)
        self._staging.upload(list(copies))

    def launch(self, graph: Any) -> None:
        graph.launch()  # on the current stream: ordered with the eager work around it

    def synchronize(self) -> None:
        self._cp.cuda.get_current_stream().synchronize()

    def pool_bytes(self) -> int:
        return int(self.arena.capacity) if self.arena is not None else int(self.pool.total_bytes()) if self.pool else 0

    def release(self) -> None:
        for pool in (self.pool, self._probe):
            if pool is not None:
                pool.free_all_blocks()
        self.pool = self.arena = self._arena_memory = self._probe = None


def build_decode_graphs(config: EngineConfig, model: Any, kv_caches: list[tuple[Any, Any]], max_model_len: int,
                        capturer: GraphCapturer | None = None, layer_group: Sequence[int] = ()) -> DecodeGraphs | None:
    """Capture the decode graphs for an engine; None on the CPU, when turned off, or when capture
    failed (logged; the engine then runs every step eagerly). `layer_group`: each layer's KV cache group, when
    the model reads several (their tables go up with each replay)."""
    if not config.enable_cuda_graphs or not model.backend.is_gpu:
        return None
    if getattr(model, "check_activations", False):  # its checks read back to the host: not capturable
        log.info("cuda_graphs.skipped", reason="activation checks are on (PAGEDSERVE_CHECK_ACTIVATIONS)")
        return None
    if capturer is None:
        try:
            capturer = CupyGraphCapturer()
        except Exception as e:  # noqa: BLE001 - a CuPy without stream capture: run eagerly
            log.warning("cuda_graphs.capture_failed", batch_size=None, error=f"{type(e).__name__}: {e}",
                        traceback=traceback.format_exc(limit=8), fallback="eager")
            return None
    block_size = int(kv_caches[0][0].shape[1])
    graphs = DecodeGraphs(model, kv_caches, resolve_batch_sizes(config), -(-max_model_len // block_size), capturer,
                          tuple(layer_group))
    return graphs if graphs.capture_all() else None
