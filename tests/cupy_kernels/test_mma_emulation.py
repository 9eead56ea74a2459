"""The host emulation's warp-level tensor-core model (_host_emulation.h) against numpy.

mma_m16n8k16<T> (mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}...) and ldmatrix_x4_trans run in a one-warp
probe kernel on the fiber scheduler; the fragments are packed and unpacked here, in numpy, from the PTX ISA's
per-lane layout (groupID g = lane >> 2, threadID_in_group t = lane % 4), written independently of the C++ model.
The bfloat16 conversion (round to nearest even from float32) is checked bit for bit against a numpy one.
Skipped when g++ is absent.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

GXX = shutil.which("g++")
HARNESS = Path(__file__).with_name("_host_emulation.h")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not found (needed to run the emulation)")

PROBE = r"""
#include "HARNESS"

template <typename T>
__global__ void mma_probe(const unsigned* a, const unsigned* b, float* d) {
    const int lane = threadIdx.x;
    unsigned af[4] = {a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3]};
    unsigned bf[2] = {b[2 * lane], b[2 * lane + 1]};
    float df[4] = {d[4 * lane], d[4 * lane + 1], d[4 * lane + 2], d[4 * lane + 3]};
    mma_m16n8k16<T>(df, af, bf);
    for (int i = 0; i < 4; ++i) d[4 * lane + i] = df[i];
}

// m: 32 rows of 8 halves (16 bytes each) in shared memory, row i holding m[i]; lane L points at row perm[L].
template <bool TRANS>
__global__ void ldmatrix_probe(const unsigned short* m, const int* perm, unsigned* r) {
    __shared__ __align__(16) unsigned short s[32][8];
    const int lane = threadIdx.x;
    for (int j = 0; j < 8; ++j) s[lane][j] = m[8 * lane + j];
    __syncthreads();
    unsigned out[4];
    if (TRANS) ldmatrix_x4_trans(out, &s[perm[lane]][0]);
    else ldmatrix_x4(out, &s[perm[lane]][0]);
    for (int i = 0; i < 4; ++i) r[4 * lane + i] = out[i];
}

static int launch_warp(int which, void** args) {
    const unsigned dims[6] = {1, 1, 1, 32, 1, 1};
    const int sizes[3] = {8, 8, 8};
    if (which == 0) return ps_launch(&mma_probe<f16>, dims, args, 3, sizes);
    if (which == 1) return ps_launch(&mma_probe<bf16>, dims, args, 3, sizes);
    if (which == 2) return ps_launch(&ldmatrix_probe<true>, dims, args, 3, sizes);
    return ps_launch(&ldmatrix_probe<false>, dims, args, 3, sizes);
}

extern "C" int run_probe(int which, void* x, void* y, void* z) {
    void* args[3] = {&x, &y, &z};
    return launch_warp(which, args);
}
extern "C" unsigned short to_bf16(float f) { return f2bf(f); }
extern "C" float from_bf16(unsigned short h) { return bf2f(h); }
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    work = tmp_path_factory.mktemp("mma")
    src = work / "probe.cpp"
    src.write_text(PROBE.replace("HARNESS", str(HARNESS)))
    so = work / "libprobe.so"
    flags = ["-std=c++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-U_FORTIFY_SOURCE"]
    proc = subprocess.run([GXX, *flags, "-o", str(so), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = ctypes.CDLL(str(so))
    out.to_bf16.restype = ctypes.c_ushort
    out.to_bf16.argtypes = [ctypes.c_float]
    out.from_bf16.restype = ctypes.c_float
    out.from_bf16.argtypes = [ctypes.c_ushort]
    return out


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even; NaN -> a quiet NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def bits_of(values: np.ndarray, kind: str) -> np.ndarray:
    return values.astype(np.float16).view(np.uint16) if kind == "f16" else bf16_bits(values)


def value_of(bits: np.ndarray, kind: str) -> np.ndarray:
    return bits.view(np.float16).astype(np.float64) if kind == "f16" else bf16_value(bits).astype(np.float64)


def pair(bits: np.ndarray, lo: tuple[int, int], hi: tuple[int, int]) -> int:
    return int(bits[lo]) | (int(bits[hi]) << 16)


def pack_fragments(a_bits, b_bits, c):
    """Per-lane A (4 regs), B (2 regs), C (4 floats) of mma.m16n8k16 .row.col, as the PTX ISA lays them out."""
    a = np.zeros((32, 4), np.uint32)
    b = np.zeros((32, 2), np.uint32)
    cf = np.zeros((32, 4), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane % 4
        for i, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            a[lane, i] = pair(a_bits, (row, col), (row, col + 1))
        for i, k in enumerate((2 * t, 2 * t + 8)):
            b[lane, i] = pair(b_bits, (k, g), (k + 1, g))
        cf[lane] = [c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]]
    return a, b, cf


def unpack_d(d: np.ndarray) -> np.ndarray:
    out = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane % 4
        out[g, 2 * t], out[g, 2 * t + 1], out[g + 8, 2 * t], out[g + 8, 2 * t + 1] = d[lane]
    return out


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("seed", range(4))
def test_mma_m16n8k16_matches_numpy(lib, kind, seed):
    rng = np.random.default_rng(seed)
    scale = 1.0 if seed < 3 else 300.0  # large products: float32 accumulation, no half-precision overflow
    a_bits = bits_of(rng.standard_normal((16, 16)) * scale, kind)
    b_bits = bits_of(rng.standard_normal((16, 8)) * scale, kind)
    c = (rng.standard_normal((16, 8)) * scale).astype(np.float32)
    a, b, d = pack_fragments(a_bits, b_bits, c)
    assert lib.run_probe(0 if kind == "f16" else 1, ptr(a), ptr(b), ptr(d)) == 0
    got = unpack_d(d).astype(np.float64)
    exact = value_of(a_bits, kind) @ value_of(b_bits, kind) + c.astype(np.float64)
    # 17 float32 additions of exact products: error below 17 ulps of the largest partial magnitude
    bound = 17 * np.finfo(np.float32).eps * (np.abs(value_of(a_bits, kind)) @ np.abs(value_of(b_bits, kind))
                                             + np.abs(c))
    assert np.all(np.abs(got - exact) <= bound), np.abs(got - exact).max()


def test_mma_is_exact_on_small_integers(lib):
    """Small integers: every product and partial sum is exact, so the layout is checked bit for bit."""
    rng = np.random.default_rng(7)
    a_vals = rng.integers(-8, 9, (16, 16)).astype(np.float32)
    b_vals = rng.integers(-8, 9, (16, 8)).astype(np.float32)
    c = rng.integers(-50, 51, (16, 8)).astype(np.float32)
    for which, kind in ((0, "f16"), (1, "bf16")):
        a, b, d = pack_fragments(bits_of(a_vals, kind), bits_of(b_vals, kind), c)
        assert lib.run_probe(which, ptr(a), ptr(b), ptr(d)) == 0
        np.testing.assert_array_equal(unpack_d(d), a_vals @ b_vals + c)


@pytest.mark.parametrize("trans", [True, False])
def test_ldmatrix_x4(lib, trans):
    """Lane 8i + r points at row r of matrix i (rows given in a shuffled order): r[i] of lane (g, t) is
    (M_i[g][2t], M_i[g][2t + 1]), or with .trans (M_i[2t][g], M_i[2t + 1][g])."""
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 1 << 16, (32, 8)).astype(np.uint16)  # 32 stored rows of 8 halves
    where = rng.permutation(32).astype(np.int32)  # matrix i's row r lives in stored row where[8i + r]
    got = np.zeros((32, 4), np.uint32)
    assert lib.run_probe(2 if trans else 3, ptr(rows), ptr(where), ptr(got)) == 0
    for lane in range(32):
        g, t = lane >> 2, lane % 4
        for i in range(4):
            m = rows[where[8 * i: 8 * i + 8]]  # 8 x 8
            if trans:
                m = m.T
            assert got[lane, i] == int(m[g, 2 * t]) | (int(m[g, 2 * t + 1]) << 16), (lane, i)


def test_bf16_round_to_nearest_even(lib):
    rng = np.random.default_rng(5)
    values = np.concatenate([
        rng.standard_normal(2000).astype(np.float32) * np.float32(1e3),
        np.array([0.0, -0.0, 1.0, 65504.0, 3.4e38, -3.4e38, 1e-40, np.inf, -np.inf], np.float32),
        # exact ties: 1 + 2^-8 (rounds down to even), 1 + 3 * 2^-8 (rounds up to even)
        np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8)], np.float32),
    ])
    want = bf16_bits(values)
    got = np.array([lib.to_bf16(float(v)) for v in values], np.uint16)
    np.testing.assert_array_equal(got, want)
    assert got[-3] == 0x3F80 and got[-2] == 0x3F82
    back = np.array([lib.from_bf16(int(h)) for h in want], np.float32)
    np.testing.assert_array_equal(back, bf16_value(want))
    assert np.isnan(lib.from_bf16(lib.to_bf16(float("nan"))))
