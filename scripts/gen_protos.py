#!/usr/bin/env python3
"""Generate the Python gRPC stubs in sidecar/pb/ from protos/**/*.proto (committed; CI checks them).

    python scripts/gen_protos.py           # regenerate sidecar/pb/*_pb2*.py(i)
    python scripts/gen_protos.py --check   # regenerate into a temp dir; exit 1 with a diff if stale

protoc writes `pagedserve/v1/generation_pb2.py` and imports sibling modules absolutely
(`from pagedserve.v1 import generation_pb2`). We flatten the files into sidecar/pb/ and make those
imports package-relative (`from . import generation_pb2`), so the stubs import as
`pagedserve.sidecar.pb.generation_pb2` and no top-level `pagedserve.v1` package is ever needed.

The output is byte-for-byte deterministic for one grpcio-tools version, which is why that version is
pinned in pyproject.toml's `test` extra.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_DIR = ROOT / "sidecar" / "pb"
# Only these files in OUT_DIR are generated; __init__.py and anything else there is hand-written.
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _is_generated(path: Path) -> bool:
    return path.name.endswith(GENERATED_SUFFIXES)


def proto_files() -> list[Path]:
    files = sorted(PROTO_ROOT.rglob("*.proto"))
    if not files:
        raise SystemExit(f"gen_protos: no .proto files under {PROTO_ROOT}")
    return files


def _proto_packages(files: list[Path]) -> list[str]:
    """Python package paths protoc derives from the protos' folders, e.g. 'pagedserve.v1'."""
    return sorted({".".join(f.parent.relative_to(PROTO_ROOT).parts) for f in files} - {""})


def _relativize(text: str, packages: list[str]) -> str:
    # `from pagedserve.v1 import generation_pb2 as ...` -> `from . import generation_pb2 as ...`.
    # Imports of well-known types (google.protobuf) and of grpc stay absolute.
    for pkg in packages:
        text = re.sub(rf"^(\s*)from {re.escape(pkg)} import ", r"\1from . import ", text, flags=re.M)
        text = re.sub(rf"^(\s*)import {re.escape(pkg)}\.(\w+)", r"\1from . import \2", text, flags=re.M)
    return text


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every proto and write the flattened, import-fixed stubs into out_dir."""
    from grpc_tools import protoc
    import grpc_tools

    files = proto_files()
    packages = _proto_packages(files)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as raw:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *(str(f.relative_to(PROTO_ROOT)) for f in files),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise SystemExit(f"gen_protos: protoc failed with exit code {rc}")
        written: list[Path] = []
        for src in sorted(Path(raw).rglob("*")):
            if not src.is_file() or not _is_generated(src):
                continue
            dest = out_dir / src.name
            if dest in written:  # flattening must not merge two protos into one file
                raise SystemExit(f"gen_protos: two protos generate {src.name}; rename one")
            dest.write_text(_relativize(src.read_text(encoding="utf-8"), packages), encoding="utf-8")
            written.append(dest)
    return written


def write() -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p for p in generate(Path(tmp))}
        for old in OUT_DIR.iterdir():
            if _is_generated(old) and old.name not in fresh:
                old.unlink()  # the proto it came from is gone
        for name, path in sorted(fresh.items()):
            shutil.copyfile(path, OUT_DIR / name)
            print(f"wrote {(OUT_DIR / name).relative_to(ROOT)}")


def check() -> str:
    """A unified diff between the committed stubs and fresh ones; empty when they are up to date."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_text(encoding="utf-8") for p in generate(Path(tmp))}
    committed = {p.name: p.read_text(encoding="utf-8") for p in OUT_DIR.glob("*") if _is_generated(p)}
    diff: list[str] = []
    for name in sorted(fresh.keys() | committed.keys()):
        a, b = committed.get(name, ""), fresh.get(name, "")
        if a != b:
            diff.extend(difflib.unified_diff(
                a.splitlines(keepends=True), b.splitlines(keepends=True),
                fromfile=f"sidecar/pb/{name} (committed)" if name in committed else "/dev/null",
                tofile=f"sidecar/pb/{name} (generated)" if name in fresh else "/dev/null"))
    return "".join(diff)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 and print a diff if sidecar/pb is stale")
    args = parser.parse_args(argv)
    if not args.check:
        write()
        return 0
    diff = check()
    if diff:
        sys.stdout.write(diff)
        print("\nsidecar/pb is stale: run `python scripts/gen_protos.py` and commit the result.",
              file=sys.stderr)
        return 1
    print("sidecar/pb is up to date.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
