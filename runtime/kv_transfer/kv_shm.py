"""Same-host KV transfer through a shared-memory segment (a file in /dev/shm, mapped by both sides).

    decode (receiver)                         prefill (sender)
    create /dev/shm/pagedserve-kv-<id>  --path in the Prefill RPC-->
                                              map it, copy its blocks out of the pool into it,
                                  <--done + crc32 per 4 MiB chunk--
    verify the checksums, copy into its pool, unlink the segment

The receiver creates and always unlinks the segment, so a sender killed mid-way leaks nothing. The
sender only opens files that look like ours, in the shared-memory folder, with exactly the expected
size, so a Prefill call cannot make it write anywhere else. One copy out of the sender's pool and one
into the receiver's: no sockets, no serialization.
"""

from __future__ import annotations

import mmap
import os
import re
import socket
import tempfile
import uuid
from pathlib import Path

import numpy as np

PREFIX = "pagedserve-kv-"
_NAME = re.compile(r"^pagedserve-kv-[0-9a-f]{32}$")


def shm_dir() -> Path:
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(tempfile.gettempdir())


def host_id() -> str:
    """Equal on two processes of one running machine (and so one /dev/shm); different across hosts."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class ShmSegment:
    """A mapped block array [num_blocks, *block_shape] in a shared file."""

    def __init__(self, path: Path, shape: tuple[int, ...], dtype: str, owner: bool) -> None:
        self.path = path
        self.owner = owner
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        with open(path, "r+b") as f:
            self._mmap = mmap.mmap(f.fileno(), nbytes)
        self.array = np.ndarray(shape, dtype=dtype, buffer=self._mmap)

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: str) -> "ShmSegment":
        path = shm_dir() / f"{PREFIX}{uuid.uuid4().hex}"
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        return cls(path, shape, dtype, owner=True)

    @classmethod
    def open(cls, path: str, shape: tuple[int, ...], dtype: str) -> "ShmSegment":
        """The sender's side: raises ValueError unless `path` is one of ours of exactly the right size."""
        p = Path(path)
        if not _NAME.match(p.name) or p.parent.resolve() != shm_dir().resolve():
            raise ValueError(f"shm_path {path!r} is not a pagedserve KV segment in {shm_dir()}")
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        try:
            size = p.stat().st_size
        except OSError as e:
            raise ValueError(f"shm_path {path!r} cannot be opened: {e}") from None
        if size != nbytes:
            raise ValueError(f"shm_path {path!r} holds {size} bytes; {nbytes} expected")
        return cls(p, shape, dtype, owner=False)

    def close(self) -> None:
        """Drop this segment's mapping; the owner (receiver) also unlinks the file. Safe to call twice.

        The mapping is not closed here: numpy arrays over an mmap keep the mmap object alive but hold no
        buffer export, so mmap.close() would unmap memory an array still points at. The engine thread may
        be copying blocks into `array` (the prefill sink) when a cancelled call closes its segment on the
        event loop; unmapping then was a segfault. The mapping goes when the last array over it does."""
        self.array = None
        self._mmap = None
        if self.owner:
            self.path.unlink(missing_ok=True)
