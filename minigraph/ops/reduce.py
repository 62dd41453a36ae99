"""Row reductions over dim 0: rms_norm, l2_norm, sum_rows (sums in double, as ggml's CPU)."""
from __future__ import annotations

import numpy as np

from ..registry import GgmlCall, Out, build, cases, op, reference, require
from ..types import f32


def _f32_rows(name, a):
    require(a.type == f32, name, f"{a.label} must be f32, got {a.type.name}")
    require(a.is_contiguous_rows(), name, f"{a.label} rows must be contiguous (nb0 == 4)")


@op("RMS_NORM", srcs=("a",), params={"eps": float}, split="per_row",
    ggml=GgmlCall("rms_norm", ("a", "eps")), cases=cases("rows", eps=1e-6))
def _rms_norm_rule(a, eps):
    _f32_rows("RMS_NORM", a)
    require(eps >= 0, "RMS_NORM", f"eps must be >= 0, got {eps}")
    return Out(f32, a.ne)


@reference("RMS_NORM")
def _rms_norm_ref(node, a):
    ss = np.sum(a.astype(np.float64) ** 2, axis=-1, keepdims=True)
    mean = (ss / a.shape[-1]).astype(np.float32)
    scale = np.float32(1) / np.sqrt(mean + np.float32(node.params["eps"]))
    return (a * scale).astype(np.float32)


def rms_norm(a, eps):
    return build("RMS_NORM", a=a, eps=eps)


@op("L2_NORM", srcs=("a",), params={"eps": float}, split="per_row",
    ggml=GgmlCall("l2_norm", ("a", "eps")), cases=cases("rows", eps=1e-6))
def _l2_norm_rule(a, eps):
    _f32_rows("L2_NORM", a)
    return Out(f32, a.ne)


@reference("L2_NORM")
def _l2_norm_ref(node, a):
    ss = np.sum(a.astype(np.float64) ** 2, axis=-1, keepdims=True).astype(np.float32)
    scale = np.float32(1) / np.maximum(np.sqrt(ss), np.float32(node.params["eps"]))
    return (a * scale).astype(np.float32)


def l2_norm(a, eps):
    return build("L2_NORM", a=a, eps=eps)


@op("SUM_ROWS", srcs=("a",), split="per_row", ggml=GgmlCall("sum_rows", ("a",)), cases=cases("rows"))
def _sum_rows_rule(a):
    _f32_rows("SUM_ROWS", a)
    return Out(f32, (1, a.ne[1], a.ne[2], a.ne[3]))


@reference("SUM_ROWS")
def _sum_rows_ref(node, a):
    return np.sum(a.astype(np.float64), axis=-1, keepdims=True).astype(np.float32)


def sum_rows(a):
    return build("SUM_ROWS", a=a)
