"""The numba set's packed float32 GEMM (cupy_kernels/numba_cpu/gemm.py) against numpy's matmul (ops.linear).

Each output of the kernel is one FMA chain over k in order; numpy's BLAS sums in its own order. Both are
float32 dot products of length `in`: the tolerance is numerics.f32_tol with scale = the largest
sum_k |x_k w_k| over the outputs. Batch invariance (a row's bits do not depend on the other rows of the
call, its place in a tile, or the thread count) is checked bit for bit.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from code_paths import run_as_avx2
from numerics import f32_tol

from pagedserve.cupy_kernels.host import malloc
from pagedserve.cupy_kernels.numba_cpu import gemm as numba_gemm, ops as numba_ops, setup as numba_setup
from pagedserve.cupy_kernels.reference import ops


def weight(out: int, inp: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((out, inp)).astype(np.float32)


@pytest.mark.parametrize("out", [1, 31, 32, 33, 100])
def test_pack_round_trip_and_shape(out):
    w = weight(out, 24, out)
    p = numba_gemm.pack(w)
    assert p.shape == (24, out) and p.dtype == np.float32 and not p.panels.flags.writeable
    assert p.panels.shape == (-(-out // numba_gemm.PANEL), 24, numba_gemm.PANEL)
    np.testing.assert_array_equal(numba_gemm.unpack(p), w)


def test_panels_and_outputs_start_on_a_cache_line():
    """The kernel's 64-byte panel loads and tile stores each stay within one cache line: the panels (plain and
    gated) and the output start on a 64-byte boundary, whatever malloc returned."""
    rng = np.random.default_rng(3)
    for out, inp, rows in ((40, 8, 11), (576, 576, 37), (960, 64, 1)):
        w = numba_gemm.pack(rng.standard_normal((out, inp), dtype=np.float32))
        gated = numba_gemm.pack_gated(*rng.standard_normal((2, out, inp), dtype=np.float32))
        x = rng.standard_normal((rows, inp), dtype=np.float32)
        for p in (w, gated):
            assert p.panels.ctypes.data % 64 == 0 and p.panels.flags.c_contiguous
        y = numba_gemm.matmul(x, w)
        assert y.ctypes.data % 64 == 0 or out % numba_gemm.PANEL  # a sliced output is a copy of numpy's
        ref = x @ numba_gemm.unpack(w).T
        np.testing.assert_allclose(y, ref, rtol=0, atol=f32_tol(np.abs(x).max() * np.abs(w.panels).max() * inp, inp))
    for shape, dtype in (((3, 5), np.float32), ((7,), np.int64), ((0, 4), np.float32)):
        a = malloc.aligned_empty(shape, dtype)
        z = malloc.aligned_zeros(shape, dtype)
        assert a.shape == z.shape == shape and a.dtype == z.dtype == dtype and a.flags.c_contiguous
        assert not z.any() and (a.size == 0 or (a.ctypes.data % 64 == 0 and z.ctypes.data % 64 == 0))


@pytest.mark.parametrize("outs", [(64, 32, 32), (64, 40), (40, 64, 32), (7,), (96, 96, 5)])
def test_pack_rows_is_pack_of_the_concatenation(outs):
    """Parts packed in place (each starting on a panel) or, when one starts inside a panel, concatenated
    first: either way the panels of the stacked weight."""
    parts = [weight(o, 24, i) for i, o in enumerate(outs)]
    got = numba_gemm.pack_rows(parts)
    want = numba_gemm.pack(np.concatenate(parts))
    assert got.shape == want.shape and not got.panels.flags.writeable
    np.testing.assert_array_equal(got.panels, want.panels)


def test_pack_rows_refuses_parts_of_different_widths():
    with pytest.raises(ValueError, match="parts of one in"):
        numba_gemm.pack_rows([weight(32, 24, 0), weight(32, 16, 1)])
    with pytest.raises(ValueError, match="parts of one in"):
        numba_gemm.pack_rows([])


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 8, 9, 11, 15, 17, 20, 23, 64, 2 * numba_gemm.ROW_BLOCK + 13])
@pytest.mark.parametrize("out,inp", [(1, 7), (33, 64), (96, 576)])
def test_matmul_matches_numpy(rows, out, inp):
    w = weight(out, inp, rows + out)
    x = np.random.default_rng(rows).standard_normal((rows, inp)).astype(np.float32)
    got = numba_gemm.matmul(x, numba_gemm.pack(w))
    ref = ops.linear(x, np.ascontiguousarray(w.T))
    assert got.shape == (rows, out) and got.dtype == np.float32 and got.flags.c_contiguous
    scale = float((np.abs(x) @ np.abs(w).T).max(initial=0.0))
    np.testing.assert_allclose(got, ref, rtol=0, atol=f32_tol(scale, inp))


def test_rows_are_batch_and_thread_invariant_bit_for_bit():
    p = numba_gemm.pack(weight(70, 100, 1))
    x = np.random.default_rng(2).standard_normal((23, 100)).astype(np.float32)
    batch = numba_gemm.matmul(x, p)  # tiles of 12, 8, 2, 1 rows (AVX2: 6, 6, 6, 4, 1)
    for r in (0, 7, 8, 20, 22):
        np.testing.assert_array_equal(numba_gemm.matmul(x[r : r + 1], p)[0], batch[r])
        np.testing.assert_array_equal(numba_gemm.matmul(x[r : r + 5], p)[0], batch[r])
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = numba_gemm.matmul_into  # the compiled kernel, on one thread
        out = np.empty((23, p.panels.shape[0] * p.panels.shape[2]), dtype=np.float32)  # whole panels (16/32 wide)
        one(np.ascontiguousarray(x), p.panels, out, 1, 0)
    finally:
        numba.set_num_threads(threads)
    np.testing.assert_array_equal(out[:, :70], batch)


@pytest.mark.parametrize("passes", [1, 2, 3, 7])
def test_rows_in_any_block_are_the_bits_of_a_lone_row(passes):
    """Rows are multiplied a block at a time (row_passes blocks of about equal size): a row in any block (and
    in a remainder tile of the last) gets the bits it gets alone."""
    p = numba_gemm.pack(weight(40, 64, 5))
    m = 2 * numba_gemm.ROW_BLOCK + 7
    x = np.random.default_rng(6).standard_normal((m, 64)).astype(np.float32)
    out = np.empty((m, p.panels.shape[0] * p.panels.shape[2]), dtype=np.float32)
    numba_gemm.matmul_into(x, p.panels, out, passes, 0)
    for r in (0, m // passes - 1, min(m // passes + 13, m - 1), m - 1):
        np.testing.assert_array_equal(numba_gemm.matmul(x[r : r + 1], p)[0], out[r, :40])


def test_row_passes_follow_the_l2(monkeypatch):
    """Blocks of about half the core's L2 of input rows, within [MIN_ROW_BLOCK, MAX_ROW_BLOCK]; ROW_BLOCK rows
    when the L2 is unknown."""
    passes = numba_gemm.row_passes
    monkeypatch.setattr(numba_gemm, "L2_BYTES", 0)
    assert [passes(m, 576) for m in (1, 120, 121, 247, 2048)] == [1, 1, 2, 3, 18]
    monkeypatch.setattr(numba_gemm, "L2_BYTES", 2 << 20)  # 2 MB: 444 rows of 576 floats, 168 of 1,536
    assert [passes(m, 576) for m in (1, 247, 444, 445, 2048)] == [1, 1, 1, 2, 5]
    assert [passes(m, 1536) for m in (168, 169, 247)] == [1, 2, 2]
    monkeypatch.setattr(numba_gemm, "L2_BYTES", 64 << 10)  # a small L2: never below MIN_ROW_BLOCK rows
    assert passes(numba_gemm.MIN_ROW_BLOCK, 4096) == 1 and passes(numba_gemm.MIN_ROW_BLOCK + 1, 4096) == 2
    monkeypatch.setattr(numba_gemm, "L2_BYTES", 1 << 30)  # nor above MAX_ROW_BLOCK
    assert passes(numba_gemm.MAX_ROW_BLOCK, 64) == 1 and passes(numba_gemm.MAX_ROW_BLOCK + 1, 64) == 2


def test_sysfs_cache_fields_parse():
    assert [numba_setup._size_bytes(t) for t in ("2048K\n", "1M", "512", "1G")] == [2 << 20, 1 << 20, 512, 1 << 30]
    assert [numba_setup._cpu_count(t) for t in ("0\n", "0-1", "0-3,8-11", "2,5")] == [1, 2, 8, 2]


def _fake_cache(root, index, level, kind, size, shared):
    d = root / f"index{index}"
    d.mkdir()
    for name, text in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (d / name).write_text(text + "\n")


def test_l2_bytes_reads_cpu0s_level_2_cache_per_sharing_cpu(tmp_path, monkeypatch):
    """The L2 probe on a fake sysfs: level 1 and instruction caches are skipped, the L2 is divided among the
    CPUs sharing it, and 0 where there is none or it cannot be read."""
    import glob

    caches = tmp_path / "caches"
    caches.mkdir()
    _fake_cache(caches, 0, "1", "Data", "48K", "0-1")
    _fake_cache(caches, 1, "2", "Instruction", "64K", "0")
    _fake_cache(caches, 2, "2", "Unified", "2048K", "0-1")
    _fake_cache(caches, 3, "3", "Unified", "32M", "0-15")
    real_glob = glob.glob
    monkeypatch.setattr(glob, "glob", lambda pattern: real_glob(str(caches / "index*")))
    assert numba_setup.l2_bytes() == 1 << 20  # 2 MB shared by 2 CPUs
    (caches / "index2" / "size").write_text("not a size\n")
    assert numba_setup.l2_bytes() == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(glob, "glob", lambda pattern: real_glob(str(empty / "index*")))
    assert numba_setup.l2_bytes() == 0
    monkeypatch.undo()
    assert numba_gemm.L2_BYTES == numba_setup.l2_bytes()  # the module's value is this machine's probe


def test_bias_strided_input_and_bad_shapes():
    w = weight(40, 32, 3)
    p = numba_gemm.pack(w)
    x = np.random.default_rng(4).standard_normal((3, 64)).astype(np.float32)[:, ::2]
    bias = np.arange(40, dtype=np.float32)
    scale = float((np.abs(x) @ np.abs(w).T).max()) + 40
    np.testing.assert_allclose(numba_gemm.matmul(x, p, bias), x @ w.T + bias, rtol=0, atol=f32_tol(scale, 32))
    with pytest.raises(ValueError, match="input of shape"):
        numba_gemm.matmul(np.ones((2, 31), np.float32), p)
    with pytest.raises(ValueError, match=r"must be \[out, in\]"):
        numba_gemm.pack(np.ones(5, np.float32))


def test_the_set_packs_float32_only_and_multiplies_either_form():
    w = weight(20, 16, 5)
    assert numba_ops.pack_weight(w.astype(np.float16)) is None
    assert ops.pack_weight(w) is None
    x = np.random.default_rng(6).standard_normal((4, 16)).astype(np.float32)
    np.testing.assert_array_equal(numba_ops.linear(x, numba_ops.pack_weight(w)),
                                  numba_gemm.matmul(x, numba_gemm.pack(w)))
    w16 = np.ascontiguousarray(w.T.astype(np.float16))
    np.testing.assert_array_equal(numba_ops.linear(x.astype(np.float16), w16), ops.linear(x.astype(np.float16), w16))


AVX2_CHECK = """
import numpy as np
from pagedserve.cupy_kernels.numba_cpu import gemm as numba_gemm
assert not numba_gemm.AVX512 and numba_gemm.PANEL == 16, (numba_gemm.AVX512, numba_gemm.PANEL)
rng = np.random.default_rng(0)
w = rng.standard_normal((37, 40)).astype(np.float32)
p = numba_gemm.pack(w)
for rows in range(14):  # 6-row tiles, then 4, 2, 1
    x = rng.standard_normal((rows, 40)).astype(np.float32)
    got = numba_gemm.matmul(x, p)
    scale = float((np.abs(x) @ np.abs(w).T).max(initial=0.0))
    assert np.abs(got - x @ w.T).max(initial=0.0) <= 1e-5 * max(scale, 1.0), rows
print("OK")
"""


def test_without_avx512_the_kernel_uses_16_column_panels_and_6_row_tiles(tmp_path):
    """numba compiles for what NUMBA_CPU_FEATURES says: AVX2 code (16 vector registers of 8 floats) takes
    the smaller tile, and the results stay right (this machine runs AVX2 code too)."""
    proc = run_as_avx2(AVX2_CHECK, tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-2000:]


@pytest.mark.parametrize("inter", [48, 40, 7])
def test_gated_matmul_is_silu_and_mul_of_the_matmul_bit_for_bit(inter):
    """pack_gated's panels hold gate and up columns side by side; the GEMM's tiles apply SiLU-and-mul before they
    store: the bits of silu_and_mul on the plain GEMM's [gate | up] output, for every tile height and for an
    intermediate size that does not fill the last panel."""
    gate, up = weight(inter, 100, 11), weight(inter, 100, 12)
    plain, gated = numba_gemm.pack_rows([gate, up]), numba_gemm.pack_gated(gate, up)
    assert gated.gated and gated.shape == plain.shape == (100, 2 * inter)
    np.testing.assert_array_equal(numba_gemm.unpack(gated), numba_gemm.unpack(plain))
    x = np.random.default_rng(13).standard_normal((2 * numba_gemm.ROW_BLOCK + 23, 100)).astype(np.float32) * 3
    for rows in (1, 2, 5, 8, 12, 13, 23, x.shape[0]):
        got = numba_gemm.matmul_silu_and_mul(x[:rows], gated)
        assert got.shape == (rows, inter)
        np.testing.assert_array_equal(got, numba_ops.silu_and_mul(numba_gemm.matmul(x[:rows], plain)))
    with pytest.raises(ValueError, match="gated"):
        numba_gemm.matmul(x, gated)  # its columns are not [gate | up]
    with pytest.raises(ValueError, match="not gated"):
        numba_gemm.matmul_silu_and_mul(x, plain)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 12, 13, 30, 250])
def test_matmul_add_is_the_add_after_the_matmul_bit_for_bit(rows):
    """out += x @ W.T with the add in the tiles (every tile height, a partial last tile, row blocks): the bits
    of out + matmul(x, w), in place; the ops' linear_add takes it on panels and the composition elsewhere."""
    rng = np.random.default_rng(rows)
    w = numba_gemm.pack(rng.standard_normal((2 * numba_gemm.PANEL, 40), dtype=np.float32))
    x = rng.standard_normal((rows, 40), dtype=np.float32)
    residual = rng.standard_normal((rows, 2 * numba_gemm.PANEL), dtype=np.float32)
    expected = residual + numba_gemm.matmul(x, w)
    out = residual.copy()
    assert numba_gemm.matmul_add(x, w, out) is out
    np.testing.assert_array_equal(out, expected)
    again = residual.copy()
    assert numba_ops.linear_add(x, w, again) is again
    np.testing.assert_array_equal(again, expected)
    ref = residual.copy()
    ops.linear_add(x, numba_gemm.unpack(w).T, ref)
    np.testing.assert_allclose(ref, expected, rtol=0, atol=f32_tol(np.abs(expected).max(), 40))


def test_matmul_add_refuses_an_output_its_tiles_cannot_write():
    rng = np.random.default_rng(0)
    w = numba_gemm.pack(rng.standard_normal((numba_gemm.PANEL, 8), dtype=np.float32))
    x = rng.standard_normal((3, 8), dtype=np.float32)
    frozen = np.zeros((3, numba_gemm.PANEL), np.float32)
    frozen.flags.writeable = False
    for bad in (np.zeros((3, numba_gemm.PANEL), np.float64), np.zeros((4, numba_gemm.PANEL), np.float32),
                np.zeros((3, 2 * numba_gemm.PANEL), np.float32)[:, ::2], frozen):
        with pytest.raises(ValueError, match="matmul_add"):
            numba_gemm.matmul_add(x, w, bad)
    narrow = numba_gemm.pack(rng.standard_normal((numba_gemm.PANEL - 3, 8), dtype=np.float32))  # a padded panel
    with pytest.raises(ValueError, match="whole"):
        numba_gemm.matmul_add(x, narrow, np.zeros((3, numba_gemm.PANEL - 3), np.float32))
    residual = np.ones((3, numba_gemm.PANEL - 3), np.float32)  # linear_add: the composition instead
    np.testing.assert_array_equal(numba_ops.linear_add(x, narrow, residual.copy()),
                                  1.0 + numba_gemm.matmul(x, narrow))
