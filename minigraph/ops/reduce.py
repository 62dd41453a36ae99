"""Row ops over dim 0: norm, rms_norm, l2_norm, sum_rows, soft_max (sums in double, as ggml's CPU)."""
from __future__ import annotations

import numpy as np

from ..registry import GgmlCall, Out, Src, build, cases, op, reference, require
from ..types import f32
from .public import public


def _f32_rows(name, a):
    require(a.type == f32, name, lambda: f"{a.label} must be f32, got {a.type.name}")
    require(a.is_contiguous_rows(), name, lambda: f"{a.label} rows must be contiguous (nb0 == 4)")


def _scaled_rows_rule(name: str):
    """The shape rule of NORM and RMS_NORM: f32 rows in, the same extents out, eps >= 0."""
    def rule(a, eps):
        _f32_rows(name, a)
        require(eps >= 0, name, lambda: f"eps must be >= 0, got {eps}")
        return Out(f32, a.ne)
    return rule


op("NORM", srcs=("a",), params={"eps": float}, split="per_row",
   ggml=GgmlCall("norm", ("a", "eps")), cases=cases("rows", eps=1e-5),
   shape="a: [n0, n1, n2, n3] f32, rows contiguous -> [n0, n1, n2, n3] (each row centred and scaled)"
   )(_scaled_rows_rule("NORM"))


@reference("NORM")
def _norm_ref(node, a):
    n = a.shape[-1]
    # the sum in double rounded to f32, then divided in f32 (ggml's order); the variance in double
    mean = np.sum(a.astype(np.float64), axis=-1, keepdims=True).astype(np.float32) / np.float32(n)
    v = (a - mean).astype(np.float32)                    # the centred row, as ggml stores it
    var = (np.sum((v * v).astype(np.float64), axis=-1, keepdims=True) / n).astype(np.float32)
    scale = np.float32(1) / np.sqrt(var + np.float32(node.params["eps"]))
    return (v * scale).astype(np.float32)


@public("NORM", """
>>> mg.norm(ctx.new_tensor_2d(mg.f32, 64, 5), 1e-5).ne
(64, 5, 1, 1)
""")
def norm(a, eps):
    """ggml_norm: each row (dim 0) minus its mean, times 1 / sqrt(variance + eps) (layer norm
    without weight and bias; the mean and the variance summed in double)."""
    return build("NORM", a=a, eps=eps)


op("RMS_NORM", srcs=("a",), params={"eps": float}, split="per_row",
   ggml=GgmlCall("rms_norm", ("a", "eps")), cases=cases("rows", eps=1e-6),
   shape="a: [n0, n1, n2, n3] f32, rows contiguous -> [n0, n1, n2, n3] (each row of n0 scaled)"
   )(_scaled_rows_rule("RMS_NORM"))


@reference("RMS_NORM")
def _rms_norm_ref(node, a):
    ss = np.sum(a.astype(np.float64) ** 2, axis=-1, keepdims=True)
    mean = (ss / a.shape[-1]).astype(np.float32)
    scale = np.float32(1) / np.sqrt(mean + np.float32(node.params["eps"]))
    return (a * scale).astype(np.float32)


@public("RMS_NORM", """
>>> mg.rms_norm(ctx.new_tensor_2d(mg.f32, 64, 5), 1e-6).ne
(64, 5, 1, 1)
""")
def rms_norm(a, eps):
    """ggml_rms_norm: each row (dim 0) times 1 / sqrt(mean(x^2) + eps)."""
    return build("RMS_NORM", a=a, eps=eps)


@op("L2_NORM", srcs=("a",), params={"eps": float}, split="per_row",
    ggml=GgmlCall("l2_norm", ("a", "eps")), cases=cases("rows", eps=1e-6),
    shape="a: [n0, n1, n2, n3] f32, rows contiguous -> [n0, n1, n2, n3] (each row of n0 scaled)")
def _l2_norm_rule(a, eps):
    _f32_rows("L2_NORM", a)
    return Out(f32, a.ne)


@reference("L2_NORM")
def _l2_norm_ref(node, a):
    ss = np.sum(a.astype(np.float64) ** 2, axis=-1, keepdims=True).astype(np.float32)
    scale = np.float32(1) / np.maximum(np.sqrt(ss), np.float32(node.params["eps"]))
    return (a * scale).astype(np.float32)


@public("L2_NORM", """
>>> mg.l2_norm(ctx.new_tensor_2d(mg.f32, 64, 5), 1e-6).ne
(64, 5, 1, 1)
""")
def l2_norm(a, eps):
    """ggml_l2_norm: each row (dim 0) times 1 / max(sqrt(sum(x^2)), eps)."""
    return build("L2_NORM", a=a, eps=eps)


@op("SUM_ROWS", srcs=("a",), split="per_row", ggml=GgmlCall("sum_rows", ("a",)), cases=cases("rows"),
    shape="a: [n0, n1, n2, n3] f32, rows contiguous -> [1, n1, n2, n3]")
def _sum_rows_rule(a):
    _f32_rows("SUM_ROWS", a)
    return Out(f32, (1, a.ne[1], a.ne[2], a.ne[3]))


@reference("SUM_ROWS")
def _sum_rows_ref(node, a):
    return np.sum(a.astype(np.float64), axis=-1, keepdims=True).astype(np.float32)


@public("SUM_ROWS", """
>>> mg.sum_rows(ctx.new_tensor_2d(mg.f32, 64, 5)).ne
(1, 5, 1, 1)
""")
def sum_rows(a):
    """ggml_sum_rows: the sum of each row (dim 0)."""
    return build("SUM_ROWS", a=a)


@op("SOFT_MAX", srcs=("a", Src("mask", optional=True)), params={"scale": float, "max_bias": float},
    split="soft_max", ggml=GgmlCall("soft_max_ext", ("a", "mask", "scale", "max_bias")),
    shape="a: [n0, n1, n2, n3] f32, contiguous; mask (optional): [n0, m1 >= n1, m2, m3] f32 with "
          "n2 % m2 == 0, n3 % m3 == 0 -> [n0, n1, n2, n3]")
def _soft_max_rule(a, scale, max_bias, mask=None):
    name = "SOFT_MAX"
    require(a.type == f32, name, lambda: f"{a.label} must be f32, got {a.type.name}")
    require(a.is_contiguous(), name, lambda: f"{a.label} must be contiguous (ggml_soft_max_ext asserts it), got nb={list(a.nb)}")
    if mask is not None:
        require(mask.type == f32, name, lambda: f"mask {mask.label} must be f32, got {mask.type.name} (ggml also "
                                        f"takes f16 masks; minigraph does not yet)")
        require(mask.is_contiguous(), name, lambda: f"mask {mask.label} must be contiguous, got nb={list(mask.nb)}")
        require(mask.ne[0] == a.ne[0], name, lambda: f"mask {mask.label} rows have {mask.ne[0]} elements, {a.label} rows {a.ne[0]}")
        require(mask.ne[1] >= a.ne[1], name, lambda: f"mask {mask.label} has {mask.ne[1]} rows, fewer than {a.label}'s {a.ne[1]}")
        require(mask.ne[2] > 0 and mask.ne[3] > 0 and a.ne[2] % mask.ne[2] == 0 and a.ne[3] % mask.ne[3] == 0, name,
                lambda: f"mask {mask.label} ne={list(mask.ne)} must broadcast over {a.label} ne={list(a.ne)} in dims 2/3 "
                f"(a.ne2 % mask.ne2 == 0, a.ne3 % mask.ne3 == 0)")
    require(max_bias == 0.0, name,
            lambda: f"max_bias={max_bias}: ALiBi slopes are not implemented, max_bias must be 0.0")
    return Out(f32, a.ne)


@reference("SOFT_MAX")
def _soft_max_ref(node, a, mask=None):
    w = (a * np.float32(node.params["scale"])).astype(np.float32)
    if mask is not None:   # rows 0 .. a.ne1-1 of the mask, tiled over dims 2/3 by modulo
        rows = mask[:, :, : a.shape[2], :]
        w = w + np.tile(rows, (a.shape[0] // mask.shape[0], a.shape[1] // mask.shape[1], 1, 1))
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(w - np.max(w, axis=-1, keepdims=True)).astype(np.float32)
        inv = (1.0 / np.sum(e.astype(np.float64), axis=-1, keepdims=True)).astype(np.float32)
        return (e * inv).astype(np.float32)


@public("SOFT_MAX", """
>>> scores, mask = ctx.new_tensor_3d(mg.f32, 6, 6, 2), ctx.new_tensor_2d(mg.f32, 6, 8)
>>> mg.soft_max_ext(scores, mask, 0.125).ne          # mask rows 0..5 used, shared by both heads
(6, 6, 2, 1)
""")
def soft_max_ext(a, mask, scale, max_bias=0.0):
    """ggml_soft_max_ext: softmax over each row of a*scale + mask (mask optional, f32, broadcast
    over a's dims 2/3; its first a.ne1 rows are used)."""
    return build("SOFT_MAX", a=a, mask=mask, scale=scale, max_bias=max_bias)


@public("SOFT_MAX", """
>>> mg.soft_max(ctx.new_tensor_2d(mg.f32, 10, 3)).ne
(10, 3, 1, 1)
""", shape="a: [n0, n1, n2, n3] f32, contiguous -> [n0, n1, n2, n3]")
def soft_max(a):
    """ggml_soft_max: softmax over each row."""
    return build("SOFT_MAX", a=a, scale=1.0, max_bias=0.0)
