"""The reference backend: runs every op's NumPy reference on real byte buffers.

Views are strided NumPy views of the base bytes (overlapping reads included) and results are
written into the node's own strided memory, so cpy/set_rows/in-place ops write through into
their destination exactly as in ggml."""
from __future__ import annotations

import numpy as np

from minigraph.backend import HostBackend, is_compute_node, register_backend
from minigraph.registry import OPS
from minigraph.sources import srcs_of
from minigraph.types import ALL_TYPES


class RefBackend(HostBackend):
    name = "ref"
    wide_types = frozenset(t.name for t in ALL_TYPES if not t.numpy_native) | {"f16"}   # NumPy takes all

    def supports_op(self, node) -> bool:
        d = OPS[node.op]
        return d.is_view or d.reference is not None

    def compute_nodes(self, nodes, cache=None):
        for node in nodes:
            if not is_compute_node(node):
                continue
            arrays = {k: self.view(s) for k, s in srcs_of(node).items()}
            result = OPS[node.op].reference(node, **arrays)   # computed whole before any write
            dst = self.view(node)
            np.copyto(dst, np.asarray(result).reshape(dst.shape), casting="unsafe")


register_backend("ref", lambda idx: RefBackend())
