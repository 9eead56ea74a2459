"""Moving a step's batch metadata to the device once, instead of once per op and layer.

build_forward_batch makes the ForwardBatch on the host (numpy). Handed numpy metadata, the CUDA op
layer checks and uploads it at every call: slot_mapping and the three attention arrays in every layer,
and cos/sin (computed on the host from numpy positions) twice per layer. `to_device` does that work
once per step:

    host ForwardBatch --check_batch--> trim block_tables --pack--> int64 [3T + N] + int32 [2B + 1 + B*W (+ B)]
                                                                        | two host->device copies
    device ForwardBatch <----------------- unpack: views into the two device buffers

The int32 buffer ends with the prompt lengths (LongRoPE's factor choice) when the batch carries them.

The check runs on the host because, given device metadata, the kernels trust it (a block id out of
range would be an illegal address that kills the CUDA context, not an exception naming the field).

Trimming: block tables arrive as wide as the longest table the KV manager holds, but the attention
kernel sizes its split-decode workspace (and the number of partitions it launches) from the table's
width when the metadata is on the device, so the width is cut to what the longest sequence of this
step needs: ceil(max(seq_lens) / block_size) columns. That width times block_size is the kernel's
max_seq_len bound (cuda_ops.paged_attention takes no separate max_seq_len argument).

cos/sin are not uploaded: with positions on the device the op layer computes them there, once per
step, from the model's device-resident inv_freq.

Uploads go through `PinnedStaging`: the packed buffers are copied into page-locked host memory and
from there to the device with cudaMemcpyAsync on the current stream, so the copy is a real DMA that
does not block the host (a copy from pageable memory is staged by the driver and synchronous).

On the numpy backend `to_device` returns the batch unchanged (the CPU path is untouched).

KV cache groups after the first (a model with sliding-window layers) are checked the same way and go up
as one more int64 buffer (their slot mappings) and one more int32 buffer (their tables, trimmed alike).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pagedserve.cupy_kernels.backend import Backend
from pagedserve.cupy_kernels.batch_checks import check_metadata, check_slot_mapping
from pagedserve.cupy_kernels.cuda.ops import is_cupy_array

from .batch import ForwardBatch

I64_FIELDS = ("input_ids", "positions", "slot_mapping", "logits_indices")


@dataclass(frozen=True)
class PackedLayout:
    """Where each field lives in the two packed buffers."""

    num_tokens: int  # T
    num_seqs: int  # B
    num_logits: int  # N
    max_blocks: int  # W, block table columns
    prompt_lens: bool = False  # B more int32 after the tables: ForwardBatch.prompt_lens

    @property
    def i64_size(self) -> int:
        return 3 * self.num_tokens + self.num_logits

    @property
    def i32_size(self) -> int:
        return (2 + self.max_blocks + int(self.prompt_lens)) * self.num_seqs + 1


def blocks_needed(seq_lens: np.ndarray, block_size: int) -> int:
    """Block table columns the longest sequence of the batch reads (at least 1)."""
    if seq_lens.size == 0:
        return 1
    return max(1, -(-int(np.max(seq_lens)) // block_size))


def check_batch(batch: ForwardBatch, block_size: int, num_blocks: int, vocab_size: int | None = None) -> None:
    """Validate host metadata against the KV cache (and vocabulary); raises ValueError / IndexError. The
    attention metadata and the slots by cupy_kernels/batch_checks.py, the checks every kernel set shares."""
    t = batch.num_tokens
    for name in ("positions", "slot_mapping"):
        if getattr(batch, name).shape != (t,):
            raise ValueError(f"ForwardBatch.{name} has shape {getattr(batch, name).shape}, expected ({t},)")
    check_metadata(batch.query_start_loc, batch.seq_lens, batch.block_tables, t, block_size, num_blocks,
                   "ForwardBatch")
    check_slot_mapping(np.asarray(batch.slot_mapping), num_blocks * block_size, "ForwardBatch", only_minus_one=True)
    if batch.prompt_lens is not None and np.shape(batch.prompt_lens) != (batch.num_seqs,):
        raise ValueError(f"ForwardBatch.prompt_lens has shape {np.shape(batch.prompt_lens)}, "
                         f"expected ({batch.num_seqs},)")
    ids = np.asarray(batch.input_ids)
    if vocab_size is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise IndexError(f"ForwardBatch.input_ids holds a token id outside [0, {vocab_size})")
    li = np.asarray(batch.logits_indices)
    if li.size and (int(li.min()) < 0 or int(li.max()) >= t):
        raise IndexError(f"ForwardBatch.logits_indices holds a row outside [0, {t})")


def pack_batch(batch: ForwardBatch, max_blocks: int) -> tuple[np.ndarray, np.ndarray, PackedLayout]:
    """The batch's metadata as one int64 and one int32 host buffer; block tables cut or zero-padded
    to `max_blocks` columns (zeros: block 0, a valid id the kernels never read past seq_len)."""
    layout = PackedLayout(batch.num_tokens, batch.num_seqs, int(np.asarray(batch.logits_indices).shape[0]),
                          max_blocks, batch.prompt_lens is not None)
    i64 = np.empty(layout.i64_size, dtype=np.int64)
    t = layout.num_tokens
    i64[:t] = batch.input_ids
    i64[t : 2 * t] = batch.positions
    i64[2 * t : 3 * t] = batch.slot_mapping
    i64[3 * t :] = batch.logits_indices
    b = layout.num_seqs
    i32 = np.zeros(layout.i32_size, dtype=np.int32)
    i32[: b + 1] = batch.query_start_loc
    i32[b + 1 : 2 * b + 1] = batch.seq_lens
    tables = np.asarray(batch.block_tables)
    width = min(max_blocks, tables.shape[1])
    end = 2 * b + 1 + b * max_blocks
    i32[2 * b + 1 : end].reshape(b, max_blocks)[:, :width] = tables[:, :width]
    if layout.prompt_lens:
        i32[end:] = batch.prompt_lens
    return i64, i32, layout


def unpack_batch(i64: Any, i32: Any, layout: PackedLayout) -> ForwardBatch:
    """A ForwardBatch of views into the packed buffers (numpy or CuPy)."""
    t, b = layout.num_tokens, layout.num_seqs
    end = 2 * b + 1 + b * layout.max_blocks
    return ForwardBatch(
        input_ids=i64[:t],
        positions=i64[t : 2 * t],
        slot_mapping=i64[2 * t : 3 * t],
        query_start_loc=i32[: b + 1],
        seq_lens=i32[b + 1 : 2 * b + 1],
        block_tables=i32[2 * b + 1 : end].reshape(b, layout.max_blocks),
        logits_indices=i64[3 * t :],
        prompt_lens=i32[end:] if layout.prompt_lens else None,
    )


class PinnedStaging:
    """Host->device copies through one reusable page-locked buffer (CuPy only).

    The buffer is rewritten only after the previous upload's copies have finished (an event recorded
    behind them), so an asynchronous copy never reads bytes the next upload is writing.
    """

    ALIGN = 256

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self.buffer: np.ndarray | None = None
        self.done: Any = None  # event after the last upload's copies
        self.num_uploads = 0

    def upload(self, copies: list[tuple[Any, np.ndarray]]) -> list[Any]:
        """Copy each host array into its device array (None: a new one); returns the device arrays."""
        cp = self.cp
        sizes = [-(-src.nbytes // self.ALIGN) * self.ALIGN for _, src in copies]
        total = max(self.ALIGN, sum(sizes))
        if self.done is not None:
            self.done.synchronize()
        if self.buffer is None or self.buffer.nbytes < total:
            self.buffer = np.frombuffer(cp.cuda.alloc_pinned_memory(total), dtype=np.uint8, count=total)
        stream = cp.cuda.get_current_stream()
        out, offset = [], 0
        for (dst, src), size in zip(copies, sizes):
            staged = self.buffer[offset : offset + src.nbytes].view(src.dtype).reshape(src.shape)
            staged[...] = src
            if dst is None:
                dst = cp.empty(src.shape, dtype=src.dtype)
            dst.set(staged, stream=stream)
            out.append(dst)
            offset += size
        self.done = stream.record()
        self.num_uploads += 1
        return out


_staging: dict[int, PinnedStaging] = {}


def _upload(xp: Any, *arrays: np.ndarray) -> list[Any]:
    """Host arrays on the device: through pinned memory for CuPy, xp.asarray otherwise (the host
    harness's stand-in CuPy, which has no pinned memory)."""
    cuda = getattr(xp, "cuda", None)
    if cuda is None or not hasattr(cuda, "alloc_pinned_memory"):
        return [xp.asarray(a) for a in arrays]
    device = int(cuda.runtime.getDevice())
    staging = _staging.get(device)
    if staging is None:
        staging = _staging[device] = PinnedStaging(xp)
    return staging.upload([(None, a) for a in arrays])


def is_on_device(batch: ForwardBatch) -> bool:
    return is_cupy_array(batch.input_ids)


def to_device(batch: ForwardBatch, backend: Backend, block_size: int, num_blocks: int,
              vocab_size: int | None = None) -> ForwardBatch:
    """The batch with its metadata on the backend's device: checked, trimmed, two uploads.

    numpy backend, or metadata already on the device (a CUDA graph's static buffers, a benchmark's
    prepared batch): returned as it is.
    """
    if not backend.is_gpu or is_on_device(batch):
        return batch
    if batch.lora_slots is not None:  # LoRA steps (models/lora.py): each row's adapter slot, one more upload
        slots = np.ascontiguousarray(batch.lora_slots, dtype=np.int32)
        if slots.shape != (batch.num_tokens,) or (slots.size and int(slots.min()) < -1):
            raise ValueError(f"ForwardBatch.lora_slots must be [{batch.num_tokens}] slots >= -1")
        on_device = to_device(replace(batch, lora_slots=None), backend, block_size, num_blocks, vocab_size)
        return replace(on_device, lora_slots=_upload(backend.xp, slots)[0])
    check_batch(batch, block_size, num_blocks, vocab_size)
    width = blocks_needed(np.asarray(batch.seq_lens), block_size)
    i64, i32, layout = pack_batch(batch, width)
    if not batch.group_block_tables:
        dev_i64, dev_i32 = _upload(backend.xp, i64, i32)
        return unpack_batch(dev_i64, dev_i32, layout)
    groups = [replace(batch, block_tables=t, slot_mapping=s, group_block_tables=(), group_slot_mappings=(),
                      prompt_lens=None)
              for t, s in zip(batch.group_block_tables, batch.group_slot_mappings)]
    for group in groups:
        check_batch(group, block_size, num_blocks)
    packed = [pack_batch(group, width) for group in groups]
    t, b = layout.num_tokens, layout.num_seqs
    slots = np.concatenate([g64[2 * t : 3 * t] for g64, _, _ in packed])
    tables = np.concatenate([g32[2 * b + 1 :] for _, g32, _ in packed])
    dev_i64, dev_i32, dev_slots, dev_tables = _upload(backend.xp, i64, i32, slots, tables)
    n = len(groups)
    return replace(unpack_batch(dev_i64, dev_i32, layout),
                   group_block_tables=tuple(dev_tables.reshape(n, b, width)[g] for g in range(n)),
                   group_slot_mappings=tuple(dev_slots.reshape(n, t)[g] for g in range(n)),
                   layer_group=batch.layer_group)
