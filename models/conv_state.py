"""The conv-state store, as llama.cpp's conv-state store refactor writes it ("graph: build the
conv slot order in each conv layer").

This is the one place that writes conv history into the recurrent memory's r cache
and its rollback slots. The graph context wraps it as build_conv_state_store(inp, s, conv_x, n_cols, offs).
"""
from __future__ import annotations

import minigraph as mg


def build_slot_rev(ctx, K: int):
    """{K-1, ..., 0} as I32, computed on the device (arange -> scale_bias -> cast); F32 is exact
    for these small integers. K never depends on the ubatch, so a reserved graph covers all."""
    s_slot_rev = mg.cast(mg.scale_bias(mg.arange(ctx, 0.0, float(K), 1.0), -1.0, float(K - 1)), mg.i32)
    return s_slot_rev.set_name("s_slot_rev")


def slot_order_tail(s_slot_rev, Kw: int):
    """The last Kw entries {Kw-1, ..., 0} of {K-1, ..., 0}."""
    K = s_slot_rev.ne[0]
    return mg.view_1d(s_slot_rev, Kw, (K - Kw) * mg.i32.size).set_name("slot_order")


def build_slot_order(ctx, K: int, Kw: int):
    """The per-layer strategy: each conv layer builds its own order next to its set_rows and views
    its tail, so the order is computed on the layer's device and never copied."""
    return slot_order_tail(build_slot_rev(ctx, K), Kw)


def conv_state_store(gf: mg.Graph, s: mg.Tensor, conv_x: mg.Tensor, n_cols: int, offs: int,
                     head: int, mem_size: int, n_rs_seq: int, slot_order: mg.Tensor | None = None):
    """Store the conv history of this ubatch.

    s      : r cache [n_embd_r, mem_size*K], row = slot*mem_size + cell
    conv_x : [n_cols + n, channels, n_seqs], contiguous; columns n_cols.. are the new tokens
    offs   : byte offset of this history inside each cache row (non-zero only for KDA parts)
    slot_order: an I32 {Kw-1..0} from elsewhere (other strategies); default: built here.
    """
    n = conv_x.ne[0] - n_cols
    channels, n_seqs = conv_x.ne[1], conv_x.ne[2]
    row_size = s.nb[1]
    cell_offs = head * row_size + offs

    if n_rs_seq == 0:
        last = mg.view_3d(conv_x, n_cols, channels, n_seqs, conv_x.nb[1], conv_x.nb[2], n * conv_x.type.size)
        cell = mg.view_2d(s, n_cols * channels, n_seqs, row_size, cell_offs)
        gf.build_forward_expand(mg.cpy(last, cell))
        return

    K = n_rs_seq + 1
    Kw = min(n, K)
    if slot_order is None:
        slot_order = build_slot_order(conv_x.ctx, K, Kw)
    # window w starts at column n-(Kw-1)+w (ascending time) and is rollback slot Kw-1-w;
    # consecutive windows start one element apart, so they overlap
    windows = mg.view_4d(conv_x, n_cols, Kw, channels, n_seqs,
                         conv_x.type.size, conv_x.nb[1], conv_x.nb[2], (n - (Kw - 1)) * conv_x.type.size)
    # [n_cols, slot, channel, seq] view of the cells of this ubatch
    slots = mg.view_4d(s, n_cols, K, channels, n_seqs,
                       mem_size * row_size, n_cols * s.type.size, row_size, cell_offs)
    gf.build_forward_expand(mg.set_rows(slots, windows, slot_order))
