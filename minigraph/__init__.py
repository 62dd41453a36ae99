"""minigraph: a lazy tensor-graph builder with ggml's semantics (ne/nb, views, op rules).

Build nodes with the op functions (ggml's names and argument order, minus the context), collect
them in a `Graph`, give leaves memory on a backend (`backend("ref" | "cpu" | "cuda:0")`,
`alloc_ctx_tensors`) and compute. Every op function's help shows its shape rule in ne order
(dim 0 fastest) and an example; `OPS` is the registry they build from."""
from .errors import OpError
from .types import DType, bf16, f16, f32, i32, i64, q4_0, q4_k, q6_k, q8_0, row_size
from .tensor import Context, Tensor
from .registry import OPS
from . import ops as _ops  # noqa: F401  (fills the registry)
from .ops.views import (view_1d, view_2d, view_3d, view_4d, view_tensor, reshape, reshape_1d,
                        reshape_2d, reshape_3d, reshape_4d, permute, transpose)
from .ops.copy import cpy, cast, cont, cont_2d, cont_3d, cont_4d, concat, repeat, repeat_4d
from .ops.index import get_rows, set_rows, arange
from .ops.elementwise import *  # noqa: F401,F403  (every unary op's function, add .. scale_bias)
from .ops.elementwise import __all__ as _elementwise_all
from .ops.reduce import norm, rms_norm, l2_norm, sum_rows, soft_max, soft_max_ext
from .ops.matmul import mul_mat
from .ops.ssm import ssm_conv, ssm_scan, gated_delta_net
from .ops.rope import rope, rope_ext, rope_multi
from .ops.attention import flash_attn_ext
from .graph import Graph
from .codec import quantize, dequantize
from .backend import Backend, Buffer, alloc_ctx_tensors, backend, register_backend
from .sched import Scheduler
from .report import PlacementReport
from .draw import draw

__version__ = "0.1.0"

__all__ = [
    # types, tensors, errors
    "DType", "f32", "f16", "i32", "i64", "bf16", "q8_0", "q4_0", "q4_k", "q6_k", "row_size", "quantize", "dequantize", "Context", "Tensor", "OpError",
    # the op registry
    "OPS",
    # op functions: views and reshapes
    "view_1d", "view_2d", "view_3d", "view_4d", "view_tensor", "reshape", "reshape_1d", "reshape_2d",
    "reshape_3d", "reshape_4d", "permute", "transpose",
    # copies and layout
    "cpy", "cast", "cont", "cont_2d", "cont_3d", "cont_4d", "concat", "repeat", "repeat_4d",
    # index ops
    "get_rows", "set_rows", "arange",
    # elementwise (binary, scale and every unary op)
    *_elementwise_all,
    # row ops, matmul, recurrent ops
    "norm", "rms_norm", "l2_norm", "sum_rows", "soft_max", "soft_max_ext", "mul_mat",
    "ssm_conv", "ssm_scan", "gated_delta_net",
    # attention building blocks
    "rope", "rope_ext", "rope_multi", "flash_attn_ext",
    # graphs, devices, scheduling
    "Graph", "Backend", "Buffer", "backend", "register_backend", "alloc_ctx_tensors", "Scheduler",
    "PlacementReport", "draw",
]
