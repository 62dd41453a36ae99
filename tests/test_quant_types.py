"""Half-precision and block types: layouts, views, raw set/read, and the codecs against real ggml
(quantize_chunk without an importance matrix, the type's to_float) byte for byte."""
from __future__ import annotations

import numpy as np
import pytest

import minigraph as mg
from minigraph import types as T
from minigraph.testing.ggml_oracle import ggml_dequantize, ggml_quantize, lib

CODEC_TYPES = [T.f16, T.bf16, T.q8_0, T.q4_0, T.q4_k, T.q6_k, T.q8_k]


@pytest.mark.parametrize("t", CODEC_TYPES + [T.f32, T.i32, T.i64], ids=lambda t: t.name)
def test_layout_matches_ggml_type_traits(t):
    traits = lib.ggml_get_type_traits(t.ggml_id)
    assert (traits.blck_size, traits.type_size) == (t.blck_size, t.size)
    assert mg.row_size(t, 4 * t.blck_size) == 4 * t.size


def test_vec_dot_types():
    assert {t.name: t.vec_dot_type.name for t in CODEC_TYPES + [T.f32]} == {
        "f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q8_0", "q4_k": "q8_k", "q6_k": "q8_k",
        "q8_k": "q8_k", "f32": "f32"}


def _cases(rng, n):
    """Rows of several scales, rows with outliers, all-equal rows and zero blocks."""
    for scale in (1e-4, 1.0, 37.0, 3e4):
        yield f"normal*{scale:g}", (rng.standard_normal((5, n)) * scale).astype(np.float32)
    x = rng.standard_normal((4, n)).astype(np.float32)
    x[:, rng.integers(0, n, n // 16)] *= 80
    yield "outliers", x
    x = np.full((4, n), 0.75, np.float32)
    x[1], x[2], x[3] = -2.5, 0.0, 1e-20
    yield "all-equal", x
    x = rng.uniform(-1, 1, (4, n)).astype(np.float32)
    x[:, : n // 2] = 0
    x[1, 32:96] = 0
    yield "zero-blocks", x
    yield "positive", rng.uniform(0.1, 3, (3, n)).astype(np.float32)
    yield "integers", rng.integers(-8, 8, (3, n)).astype(np.float32)
    # exact halves after scaling (127 makes q8's scale 1): the reference rounds them away from zero
    yield "ties", np.tile(np.r_[127.0, np.arange(31) - 15.5], (2, n // 32)).astype(np.float32)


@pytest.mark.parametrize("t", CODEC_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_and_dequantize_agree_with_ggml_byte_for_byte(t, seed):
    rng = np.random.default_rng(seed)
    n = 512 if t.blck_size > 32 else 96
    for label, x in _cases(rng, n):
        ours, theirs = mg.quantize(x, t), ggml_quantize(x, t)
        assert ours.shape == (x.shape[0], mg.row_size(t, n)), label
        diff = np.flatnonzero((ours != theirs).any(axis=1))
        assert diff.size == 0, f"{t.name} {label}: rows {diff} differ"
        back, ref = mg.dequantize(theirs, t), ggml_dequantize(theirs, t)
        assert np.array_equal(back.view(np.uint32), ref.view(np.uint32)), f"{t.name} {label}: to_float differs"


def test_bf16_rounding_and_nan_match_ggml():
    x = np.array([1.0, 1.00390625, 1.01171875, -3e38, np.nan, np.inf, 1e-40, -0.0] * 4, np.float32)
    assert np.array_equal(mg.quantize(x[None], mg.bf16), ggml_quantize(x[None], T.bf16))


@pytest.mark.parametrize("t", [T.q8_0, T.q4_0, T.q4_k, T.q6_k], ids=lambda t: t.name)
def test_block_tensor_layout_set_and_read(t):
    ne0 = 2 * t.blck_size
    ctx = mg.Context()
    w = ctx.new_tensor_3d(t, ne0, 3, 2)
    assert w.nb == (t.size, 2 * t.size, 6 * t.size, 12 * t.size) and w.nbytes() == 12 * t.size
    assert w.storage_shape == (2, 3, 2 * t.size)
    mg.alloc_ctx_tensors(ctx, mg.backend("ref"))
    x = np.random.default_rng(3).standard_normal((2, 3, ne0)).astype(np.float32)
    raw = mg.quantize(x, t)
    w.set(raw)
    assert np.array_equal(w.numpy(), raw)
    w.set(raw.tobytes())                                   # bytes of the right size
    assert np.array_equal(mg.dequantize(w), mg.dequantize(raw, t))
    row = mg.view_2d(w, ne0, 2, w.nb[1], w.nb[1])          # rows 1..2 of the first matrix
    assert np.array_equal(row.numpy(), raw[0, 1:])
    half = mg.view_1d(w, t.blck_size, t.size)              # the second block
    assert np.array_equal(half.numpy(), raw[0, 0, t.size:])


@pytest.mark.parametrize("make, text", [
    (lambda w: mg.view_1d(w, 32, 2), "must start on a block boundary and keep whole blocks in dim 0: it starts at byte 2"),
    (lambda w: mg.view_1d(w, 16, 0), "ne0=16 is not a multiple of 32"),
    (lambda w: mg.view_2d(w, 32, 2, 20, 0), "stride 20 is not whole blocks of 18 bytes"),
    (lambda w: mg.transpose(w), "packed in blocks along dim 0, which must stay dim 0"),
    (lambda w: mg.ssm_conv(w, w), "SSM_CONV: source 'sx' 'w' is q4_0: SSM_CONV does not take q4_0"),
    (lambda w: mg.add(w, w), "ADD: source 'a' 'w' is q4_0: ADD does not take q4_0"),
    (lambda w: mg.Context().new_tensor_1d(mg.q4_0, 40), "ne[0]=40 must be a multiple of the block size 32"),
])
def test_block_views_and_ops_refuse_with_the_rule(make, text):
    w = mg.Context().new_tensor_2d(mg.q4_0, 64, 3)
    w.name = "w"
    with pytest.raises(mg.OpError) as e:
        make(w)
    assert text in str(e.value) and "\n" not in str(e.value)


def test_set_refuses_wrong_sizes_and_dtypes():
    ctx = mg.Context()
    w = ctx.new_tensor_2d(mg.q8_0, 32, 2)
    w.name = "w"
    mg.alloc_ctx_tensors(ctx, mg.backend("ref"))
    with pytest.raises(mg.OpError, match="'w'.*rows of 34 bytes"):
        w.set(np.zeros(67, np.uint8))
    with pytest.raises(mg.OpError, match="dtype float32 does not match .* q8_0 .*raw blocks"):
        w.set(np.zeros((2, 32), np.float32))
    with pytest.raises(mg.OpError, match="quantize to q4_k: the last axis \\(32\\) must be a multiple of the block size 256"):
        mg.quantize(np.ones((1, 32)), mg.q4_k)
    with pytest.raises(mg.OpError, match="dequantize q8_0: 68 bytes do not hold rows of 48 values"):
        mg.dequantize(bytes(68), mg.q8_0, shape=(2, 48))
    with pytest.raises(mg.OpError, match="dequantize: give the type"):
        mg.dequantize(bytes(34))
    assert mg.dequantize(bytes(68), mg.q8_0, shape=(2, 32)).shape == (2, 32)


@pytest.mark.parametrize("t", [T.f16, T.bf16, T.q8_0, T.q4_0, T.q4_k, T.q6_k], ids=lambda t: t.name)
def test_mul_mat_is_ggmls_arithmetic_not_a_float_product(t):
    """Against real ggml: NMSE <= 1e-10, and far below that of dequantize-then-multiply in float
    (which skips the conversion of src1 to the vec_dot type)."""
    from minigraph.testing.op_cases import Built, nmse, run_built
    from minigraph.testing.ggml_oracle import run_in_ggml
    rng = np.random.default_rng(7)
    K, M, N = 512, 24, 6
    b = Built(mg.Context())
    raw = mg.quantize(rng.standard_normal((M, K)).astype(np.float32), t)
    a = b.ctx.new_tensor_2d(t, K, M)
    b.data[a] = raw if t.is_quantized else raw.view(t.np_dtype).reshape(M, K)
    x = b.leaf(T.f32, (K, N), data=rng.standard_normal((N, K)))
    b.out(mg.mul_mat(a, x))
    ours = run_built(b, mg.backend("ref"))[0].reshape(N, M)
    theirs = run_in_ggml(b)[0].reshape(N, M)
    floats = (mg.dequantize(raw.reshape(M, -1), t).astype(np.float64) @ b.data[x].reshape(N, K).T.astype(np.float64)).T
    err, err_float = nmse(ours, theirs), nmse(floats, theirs)
    print(f"mul_mat {t.name} K={K}: NMSE vs ggml {err:.2e}, dequantize-then-float {err_float:.2e}")
    assert err <= 1e-10 and err <= err_float / 1000, (err, err_float)
