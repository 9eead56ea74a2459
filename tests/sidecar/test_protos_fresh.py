"""The committed stubs in sidecar/pb/ match protos/ (regenerated with the pinned grpcio-tools) and load
with the installed protobuf and grpcio."""

from __future__ import annotations

import importlib.util
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pinned_grpcio_tools() -> str:
    # A regex, not tomllib: the project supports Python 3.10.
    m = re.search(r'^test = \[.*"grpcio-tools==([\w.]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M)
    if m:
        return m.group(1)
    raise AssertionError("pyproject.toml's test extra must pin grpcio-tools==X (stubs are only reproducible "
                         "with one protoc)")


def test_grpcio_tools_is_the_pinned_version():
    pinned, installed = _pinned_grpcio_tools(), metadata.version("grpcio-tools")
    assert installed == pinned, (f"grpcio-tools {installed} is installed but {pinned} is pinned; the freshness "
                                 f"check is only meaningful with the pinned one")


def test_committed_stubs_are_fresh():
    gen = _load_gen_protos()
    if metadata.version("grpcio-tools") != _pinned_grpcio_tools():
        pytest.skip("another grpcio-tools is installed (see test_grpcio_tools_is_the_pinned_version)")
    diff = gen.check()
    assert not diff, ("sidecar/pb is stale; run `python scripts/gen_protos.py` and commit the result:\n"
                      + diff[:4000])


def test_check_detects_a_stale_file(tmp_path, monkeypatch):
    gen = _load_gen_protos()
    for f in (ROOT / "sidecar" / "pb").glob("*_pb2*"):
        (tmp_path / f.name).write_text(f.read_text())
    monkeypatch.setattr(gen, "OUT_DIR", tmp_path)
    pb2 = tmp_path / "generation_pb2.py"
    pb2.write_text(pb2.read_text() + "# hand edit\n")
    (tmp_path / "gone_pb2.py").write_text("# from a deleted proto\n")
    diff = gen.check()
    assert "+# hand edit" not in diff and "-# hand edit" in diff
    assert "sidecar/pb/gone_pb2.py (committed)" in diff
    assert gen.main(["--check"]) == 1


def test_imports_are_package_relative():
    for f in (ROOT / "sidecar" / "pb").glob("*_pb2*.py*"):
        text = f.read_text()
        assert not re.search(r"^\s*(from|import) pagedserve\.v1\b", text, flags=re.M), f.name
    assert "from . import generation_pb2 as" in (ROOT / "sidecar" / "pb" / "generation_pb2_grpc.py").read_text()


def test_stubs_load_with_the_installed_runtime():
    # Importing runs protobuf's gencode/runtime version check and grpc's GRPC_GENERATED_VERSION check;
    # either raises if the installed protobuf or grpcio is older than the generator.
    from google.protobuf import __version__ as protobuf_version
    from pagedserve.sidecar.pb import generation_pb2 as pb
    from pagedserve.sidecar.pb import generation_pb2_grpc as pb_grpc

    gencode = re.search(r"# Protobuf Python Version: ([\d.]+)", (ROOT / "sidecar/pb/generation_pb2.py").read_text())
    as_tuple = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)[:3])  # noqa: E731
    assert as_tuple(protobuf_version) >= as_tuple(gencode.group(1))
    assert "pagedserve.sidecar.pb.generation_pb2" in sys.modules
    assert "pagedserve.v1" not in sys.modules  # no stray top-level package

    service = pb.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "pagedserve.v1.Generation"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "Tokenize", "Detokenize", "GetModelInfo", "GetServerStats", "Abort"}
    assert methods["Generate"].server_streaming and not methods["Tokenize"].server_streaming
    assert hasattr(pb_grpc, "GenerationStub") and hasattr(pb_grpc, "add_GenerationServicer_to_server")

    # optional scalars carry presence: temperature=0 is not "unset"
    msg = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=0.0, stop=["\n"]))
    back = pb.GenerateRequest.FromString(msg.SerializeToString())
    assert back.sampling.HasField("temperature") and not back.sampling.HasField("top_p")
    assert back.WhichOneof("prompt") == "text" and list(back.sampling.stop) == ["\n"]


def test_sampling_message_covers_runtime_sampling_params():
    from pagedserve.runtime.sampling_params import SamplingParams
    from pagedserve.sidecar.pb import generation_pb2 as pb
    import dataclasses

    proto_fields = {f.name: f for f in pb.SamplingParams.DESCRIPTOR.fields}
    for f in dataclasses.fields(SamplingParams):
        assert f.name in proto_fields, f"SamplingParams.{f.name} is missing from the proto"
        pf = proto_fields[f.name]
        # every scalar has presence, so "unset" can mean "the server's default"
        assert pf.has_presence or pf.is_repeated, f.name
