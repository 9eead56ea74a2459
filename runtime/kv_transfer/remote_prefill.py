"""The engine's side of disaggregated prefill: start transfers, land the blocks, fall back on faults.

Decode side, one request (seq 0 of its group; forks and beams follow it as usual)::

    add_prepared -> try_start: n = (prompt_len - 1) // block_size full blocks may come from remote
                    local prefix hit of k blocks (k < n) -> allocate blocks k..n-1 (all-or-nothing)
                    status WAITING_FOR_REMOTE_KVS, connector.start_load(...)
    step -> poll:   ok     -> write the blocks, hash them into the prefix cache,
                              num_computed_tokens = n * block_size, hand it to the scheduler as running
                              (its tail of 1..block_size tokens is computed here, giving the logits)
                    failed -> free its blocks; prefill it here (cut/corrupt data: always, once;
                              target down or late: if fallback is "local") or fail it (fallback "fail")

Prefill side: ``export_blocks`` runs the request's KVExport sink in the step that completes its
prompt, before the usual finish frees the blocks.
"""

from __future__ import annotations

import time

import structlog

from ..core.kv_cache_manager import KVCacheManager
from .kv_connector import KVBlockIO, KVConnector, KVLoadResult, KVLoadSpec, KVTransferError, KVTransferStats
from ..core.request import Request
from ..core.scheduler import Scheduler

log = structlog.get_logger("pagedserve.kv")

FALLBACKS = ("local", "fail")


class RemotePrefill:
    def __init__(self, connector: KVConnector, scheduler: Scheduler, block_io: KVBlockIO,
                 stats: KVTransferStats, fallback: str = "local") -> None:
        if fallback not in FALLBACKS:
            raise ValueError(f"prefill_fallback must be one of {list(FALLBACKS)}, got {fallback!r}")
        self.connector = connector
        self.block_size = scheduler.kv.block_size
        self.scheduler = scheduler
        self.block_io = block_io
        self.stats = stats
        self.fallback = fallback
        self._specs: dict[str, KVLoadSpec] = {}

    def try_start(self, request: Request) -> bool:
        """Start fetching the request's missing full prompt blocks. True: the request is queued (waiting for
        its KV, or for a local prefill if the transport could not start); False: queue it as usual."""
        bs = self.block_size
        n = (request.num_prompt_tokens - 1) // bs  # every full block but the one holding the last token
        kv = self.scheduler.kv
        if n and kv.prefix_key(None, n * bs) != kv.prefix_key(None, request.num_prompt_tokens):
            # LongRoPE: the prefill instance's prompt (these blocks alone) would take the other factor set
            self._fell_back(request, "its remote blocks alone would be rotated with other LongRoPE factors")
            return False
        if not self._has_lora_slot(request):  # queued as usual: the scheduler admits it once its adapter has a slot
            return False
        started = self.scheduler.start_remote_kv(request, n)  # admission: the scheduler's
        if isinstance(started, str):
            if started != "cached":  # "cached": everything but the tail is here already, nothing to fetch
                self._fell_back(request, started)
            return False
        first_block, dst_block_ids = started
        lora = request.lora_request
        spec = KVLoadSpec(request.request_id, request.prompt_token_ids[: n * bs], request.cache_salt,
                          first_block=first_block, dst_block_ids=dst_block_ids,
                          lora_name=lora.lora_name if lora is not None else None)
        self._specs[request.request_id] = spec
        try:
            self.connector.start_load(spec)
        except Exception as e:  # a transport that cannot even start (shut down, out of threads): prefill here
            del self._specs[request.request_id]
            self._fell_back(request, f"local error: {e!r}")
            self.scheduler.remote_kv_failed(request)  # queued for a local prefill
        return True

    def _has_lora_slot(self, request: Request) -> bool:
        """A request with a LoRA adapter skips the scheduler's admission when its KV comes from afar: its slot is
        taken here (runtime/lora/manager.py), or it is prefilled here once it can get one."""
        lora = self.scheduler.lora
        if request.lora_request is None or lora is None:
            return True
        try:
            return lora.acquire(request.request_id, request.lora_request)
        except ValueError:
            return False  # the scheduler fails it with the reason

    def abort(self, request_id: str) -> None:
        if self._specs.pop(request_id, None) is not None:
            self.connector.abort(request_id)

    def poll(self) -> list[tuple[str, Exception]]:
        """Land finished transfers. Returns (group request id, error) for requests failed by policy."""
        failed: list[tuple[str, Exception]] = []
        for result in self.connector.get_finished():
            try:
                spec = self._specs.pop(result.request_id, None)
                request = self.scheduler.waiting_for_kv.get(result.request_id)
                if spec is None or request is None:
                    continue  # aborted meanwhile: its blocks are already free here
                if result.ok:
                    self._land(request, spec, result)
                elif result.broken or self.fallback == "local":
                    self._fell_back(request, result.error)
                    self.scheduler.remote_kv_failed(request)
                else:
                    failed.append((request.group.request_id if request.group else request.request_id,
                                   KVTransferError(f"remote prefill failed and --prefill-fallback is fail: "
                                                   f"{result.error}")))
            finally:
                result.release()
        return failed

    def _land(self, request: Request, spec: KVLoadSpec, result: KVLoadResult) -> None:
        t0 = time.monotonic()
        if result.data is not None:
            self.block_io.write(spec.dst_block_ids, result.data)
        self.scheduler.remote_kv_landed(request, spec.num_blocks)
        s = self.stats
        seconds = result.transfer_s + time.monotonic() - t0
        s.remote_prefills += 1
        s.kv_blocks_received += len(spec.dst_block_ids)
        s.kv_bytes_received += result.num_bytes
        s.kv_transfer_s += seconds
        log.info("kv.received", request_id=request.request_id, blocks=len(spec.dst_block_ids),
                 cached_blocks=spec.first_block, bytes=result.num_bytes, transfer_s=round(seconds, 6),
                 transport=result.transport)

    def _fell_back(self, request: Request, reason: str | None) -> None:
        s = self.stats
        s.local_prefill_fallbacks += 1
        key = (reason or "unknown").split(":")[0][:60]
        s.fallback_reasons[key] = s.fallback_reasons.get(key, 0) + 1
        log.warning("kv.local_prefill_fallback", request_id=request.request_id, reason=reason)


def export_blocks(request: Request, kv: KVCacheManager, block_io: KVBlockIO, stats: KVTransferStats) -> None:
    """Prefill side: hand the request's full blocks from `first_block` on to its sink, once."""
    export, request.kv_export = request.kv_export, None
    t0 = time.monotonic()
    n = request.num_prompt_tokens // kv.block_size
    block_ids = kv.block_table(request.request_id)[export.first_block : n]
    try:
        export.result = export.sink(block_io, block_ids)
        export.num_blocks = len(block_ids)
    except Exception as e:  # a bad segment or a full disk fails this transfer, never the engine
        export.error = repr(e)
        log.error("kv.export_failed", request_id=request.request_id, error=repr(e))
    export.export_s = time.monotonic() - t0
