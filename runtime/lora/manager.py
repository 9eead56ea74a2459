"""LoRAManager: the adapter registry, the model's execution slots, the host LRU, and disk reads off the step.

    registered names  (unbounded: name -> LoRARequest)          what requests may name
    host cache        (OrderedDict, LRU, <= max_cpu_loras)       adapters read and checked (float32 arrays)
    slots             (max_loras: models/lora.py LoRASlots)      what a step's rows can run with

A waiting request whose adapter has no slot is passed over by the scheduler (acquire answers False) without
holding up the requests behind it. acquire gives the adapter a slot: its own if resident (a hit), else a free
one, else the least recently used slot that no running request holds (an eviction); the weights come from the
host cache (a load: a copy into the stacked arrays). An adapter missing from the host cache (evicted by the
LRU) is read from disk on a worker thread while its requests wait. Each running sequence holds its slot from
admission until it finishes or is preempted (release, a scheduler release hook).

Threads: register/remove/list run on any thread (the event loop hands disk reads to a thread); acquire,
slot_for and release run on the engine's step thread, the only one that writes the slots. One lock guards the
dicts; a slot is only written between steps (acquire runs in the scheduler, before the forward).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from pagedserve.models.loading.peft import LoRAAdapter, load_peft_adapter

from .request import LoRARequest

log = structlog.get_logger("pagedserve.lora")


@dataclass
class LoRAStats:
    loaded: int  # adapters registered (servable by name)
    resident: int  # adapters in an execution slot
    hits: int  # admissions that found their adapter resident
    loads: int  # copies of an adapter into a slot
    evictions: int  # slots taken from a resident adapter no request held
    slot_bytes: int  # the slots' arrays (counted in the memory budget)


class LoRAManager:
    def __init__(self, slots: Any, model_config: Any, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None = None) -> None:
        self.slots, self.model_config = slots, model_config
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.failed: list[tuple[Any, Exception]] = []  # (request, error): admits() found its adapter unreadable
        self.max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        self._lock = threading.Lock()
        self.registered: dict[str, LoRARequest] = {}
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._reading: dict[str, Future] = {}
        self._slot_name: list[str | None] = [None] * max_loras
        self._slot_refs = [0] * max_loras
        self._slot_used = [0] * max_loras  # a clock tick of the last acquire: the LRU among unheld slots
        self._clock = 0
        self._held: dict[str, int] = {}  # sequence id -> slot
        self._errors: dict[str, Exception] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-lora-read")
        self._updates: list[tuple[int, LoRAAdapter]] = []  # (slot, adapter) copies for the next forward
        self.hits = self.loads = self.evictions = 0

    # -- the registry (any thread) ----------------------------------------------------------------------

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter from disk (slow: call it off the event loop); ValueError naming the problem."""
        return load_peft_adapter(request.lora_path, self.model_config, self.max_lora_rank)

    def register(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Make `request.lora_name` servable; reads the adapter now unless `adapter` (read already) is given.
        The same name again with the same path is a no-op; with another path or id, a ValueError."""
        with self._lock:
            known = self.registered.get(request.lora_name)
        if known is not None:
            if known != request:
                raise ValueError(f"LoRA adapter {request.lora_name!r} is already loaded (id {known.lora_int_id}, "
                                 f"path {known.lora_path}); unload it first")
            return
        adapter = adapter if adapter is not None else self.read(request)
        with self._lock:
            self._errors.pop(request.lora_name, None)
            self.registered[request.lora_name] = request
            self._cache(request.lora_name, adapter)
        log.info("lora.loaded", lora_name=request.lora_name, lora_int_id=request.lora_int_id,
                 rank=adapter.rank, modules=list(adapter.target_modules))

    def remove(self, name: str) -> None:
        """Unregister `name`; KeyError if unknown; ValueError while running requests hold it."""
        with self._lock:
            if name not in self.registered:
                raise KeyError(name)
            if name in self._slot_name:
                slot = self._slot_name.index(name)
                if self._slot_refs[slot]:
                    raise ValueError(f"LoRA adapter {name!r} is in use by {self._slot_refs[slot]} running "
                                     f"sequence(s); unload it when they finish")
                self._slot_name[slot] = None  # its weights are overwritten by the next occupant
            del self.registered[name]
            self._host.pop(name, None)
        log.info("lora.unloaded", lora_name=name)

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self.registered.get(name)

    def list(self) -> list[LoRARequest]:
        with self._lock:
            return list(self.registered.values())

    def _cache(self, name: str, adapter: LoRAAdapter) -> None:
        """Into the host LRU (lock held), the least recently used beyond max_cpu_loras dropped."""
        self._host[name] = adapter
        self._host.move_to_end(name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    # -- slots (the step thread) -----------------------------------------------------------------------

    def admits(self, request: Any) -> bool:
        """The scheduler's admission condition: False while the request's adapter has no slot (it waits, the requests
        behind it do not); an adapter that cannot be read goes to `failed`, and the scheduler fails that request."""
        if request.lora_request is None:
            return True
        try:
            return self.acquire(request.request_id, request.lora_request)
        except ValueError as e:
            if all(r is not request for r, _ in self.failed):
                self.failed.append((request, e))
            return False

    def acquire(self, seq_id: str, request: LoRARequest) -> bool:
        """Give sequence `seq_id` a slot holding its adapter: True when it has one, False to wait (no free slot,
        or the adapter is being read back from disk). ValueError: the adapter is unknown or cannot be read."""
        if seq_id in self._held:
            return True
        name = request.lora_name
        with self._lock:
            if self.registered.get(name) != request:
                raise ValueError(f"LoRA adapter {name!r} is not loaded")
            error = self._errors.pop(name, None)
            if error is not None:
                raise ValueError(f"LoRA adapter {name!r} could not be read again: {error}")
            self._clock += 1
            if name in self._slot_name:
                slot = self._slot_name.index(name)
                self.hits += 1
            else:
                adapter = self._host_copy(request)
                if adapter is None:
                    return False
                slot = self._free_slot()
                if slot is None:
                    return False
                self._updates.append((slot, adapter))  # every rank copies it in before the next forward
                self._slot_name[slot] = name
                self.loads += 1
            self._slot_refs[slot] += 1
            self._slot_used[slot] = self._clock
            self._held[seq_id] = slot
            return True

    def _host_copy(self, request: LoRARequest) -> LoRAAdapter | None:
        """The adapter from the host LRU, or None while a worker thread reads it back (lock held)."""
        name = request.lora_name
        adapter = self._host.get(name)
        if adapter is not None:
            self._host.move_to_end(name)
            return adapter
        if name not in self._reading:
            self._reading[name] = self._reader.submit(self._read_back, request)
        return None

    def _read_back(self, request: LoRARequest) -> None:
        try:
            adapter = self.read(request)
        except Exception as e:  # noqa: BLE001  (the waiting requests fail with it)
            with self._lock:
                self._reading.pop(request.lora_name, None)
                if self.registered.get(request.lora_name) == request:
                    self._errors[request.lora_name] = e
            return
        with self._lock:
            self._reading.pop(request.lora_name, None)
            if self.registered.get(request.lora_name) == request:
                self._cache(request.lora_name, adapter)

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one no sequence holds (an eviction), else None."""
        if None in self._slot_name:
            return self._slot_name.index(None)
        idle = [s for s in range(self.max_loras) if self._slot_refs[s] == 0]
        if not idle:
            return None
        slot = min(idle, key=lambda s: self._slot_used[s])
        log.info("lora.evicted", lora_name=self._slot_name[slot], slot=slot)
        self.evictions += 1
        return slot

    def slot_for(self, seq_id: str, request: LoRARequest) -> int:
        """The slot sequence `seq_id` runs with (a forked sample or beam takes its parent's resident adapter)."""
        if seq_id not in self._held and not self.acquire(seq_id, request):
            raise ValueError(f"LoRA adapter {request.lora_name!r} has no execution slot for sequence {seq_id}")
        return self._held[seq_id]

    def release(self, seq_id: str) -> None:
        """Sequence `seq_id` stopped running (finished, aborted or preempted): its slot may be evicted."""
        slot = self._held.pop(seq_id, None)
        if slot is not None:
            self._slot_refs[slot] -= 1

    def take_updates(self) -> list[tuple[int, LoRAAdapter]]:
        """The slot copies acquire decided since the last step, for ExecuteModelRequest.lora_updates (each rank's
        worker applies them, its own slices, before the forward)."""
        updates, self._updates = self._updates, []
        return updates

    def waiting_for_read(self) -> bool:
        with self._lock:
            return bool(self._reading)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def stats(self) -> LoRAStats:
        with self._lock:
            return LoRAStats(len(self.registered), sum(n is not None for n in self._slot_name), self.hits, self.loads,
                             self.evictions, self.slots.nbytes)

    def shutdown(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)
