"""The attention graph inputs and builders: llama.cpp's llm_graph_input_attn_kv (self_k_idxs,
self_v_idxs, self_kq_mask with set_input / can_reuse) and build_attn over the KV cache
(cpy_k / cpy_v through set_rows, get_k / get_v views, the non-flash attention).

The graph reads the KV cache through views of cells [0, n_kv): n_kv is baked into the graph,
so a graph is reused only while n_kv and n_tokens (the mask's shape) stay the same."""
from __future__ import annotations

import numpy as np

import minigraph as mg

from .graph import REUSABLE, GraphInput, _differs, write_input
from .kv_cache import GGML_KQ_MASK_PAD, KVCache, pad_to


class InputAttnKV(GraphInput):
    """llm_graph_input_attn_kv: the cells of the ubatch's tokens (k_idxs, and v_idxs into the
    transposed V: one index per token and value channel, one input per V width the layers have)
    and the mask [n_kv, n_tokens] (rows padded to GGML_KQ_MASK_PAD)."""

    def __init__(self, kv: KVCache, k_idxs: mg.Tensor, v_idxs: dict, kq_mask: mg.Tensor, causal: bool):
        self.kv = kv
        self.self_k_idxs, self.self_v_idxs, self.self_kq_mask = k_idxs, v_idxs, kq_mask
        self.causal = causal
        self._v_rows: dict = {}   # (V width, kv_size) -> each channel row's first element

    def set_input(self, ubatch):
        kv = self.kv
        write_input(self.self_k_idxs, kv.idxs)
        for width, t in self.self_v_idxs.items():
            self._set_v_idxs(kv, width, t)
        mask = self.self_kq_mask
        n_kv, n_rows = mask.ne[0], mask.ne[1]
        if ubatch.n_tokens <= FEW_TOKENS and min(n_kv, kv.cells.hi) <= FEW_CELLS:
            write_input(mask, kq_mask_list(kv, ubatch, n_kv, n_rows, self.causal))
        else:
            mask.set(kq_mask_values(kv, ubatch, n_kv, n_rows, self.causal))

    def _set_v_idxs(self, kv, width: int, t: mg.Tensor):
        # token t, channel ch of v_cur (element t*width + ch) -> element ch*kv_size + cell: the
        # channel rows' first elements (kept) plus each token's cell; a decode step's one cell
        # takes one NumPy call
        rows = self._v_rows.get((width, kv.size))
        if rows is None:
            rows = self._v_rows[(width, kv.size)] = np.arange(width, dtype=np.int64) * kv.size
        idxs = kv.idxs
        write_input(t, rows + idxs[0] if len(idxs) == 1 else
                    (rows[None, :] + np.asarray(idxs, np.int64)[:, None]).reshape(-1))

    def can_reuse(self, params):
        kv = params.mctx.kv                         # rebind first, as InputRS does
        self.kv = kv
        n_tokens = params.ubatch.n_tokens
        if sorted(self.self_v_idxs) != kv.v_widths:
            return _differs("v_idxs (V widths)", sorted(self.self_v_idxs), kv.v_widths)
        n_v = sum(t.ne[0] for t in self.self_v_idxs.values())
        for rule, old, new in (("k_idxs (n_tokens)", self.self_k_idxs.ne[0], n_tokens),
                               ("v_idxs (n_tokens)", n_v, n_tokens * sum(kv.v_widths)),
                               ("kq_mask (n_kv)", self.self_kq_mask.ne[0], kv.n_kv),
                               ("kq_mask (n_tokens)", self.self_kq_mask.ne[1],
                                pad_to(n_tokens, GGML_KQ_MASK_PAD))):
            v = _differs(rule, old, new)
            if not v:
                return v
        return REUSABLE


def kq_mask_values(kv: KVCache, ub, n_kv: int, n_rows: int, causal: bool = True) -> np.ndarray:
    """[n_rows, n_kv] in NumPy order: 0 where token i may see cell j, -inf where it may not (an
    empty cell, another sequence, a later position when causal); padded rows are all -inf.
    A token with several seq ids sees by its first, as llama.cpp does."""
    cells = kv.cells
    n = min(n_kv, cells.hi)             # cells past hi never held a position: masked, as every empty one
    pos = np.asarray(cells.pos[:n])
    first = [ids[0] for ids in ub.seq_id]
    owns = {s: np.fromiter(cells.holds(s, n), bool, n) for s in set(first)}
    seen = np.stack([owns[s] for s in first]) & (pos >= 0)[None, :]          # [n_tokens, n]
    if causal:
        seen &= pos[None, :] <= np.asarray(ub.pos, np.int64)[:, None]
    mask = np.full((n_rows, n_kv), -np.inf, np.float32)
    mask[:ub.n_tokens, :n][seen] = 0.0
    return mask


# a ubatch of at most FEW_TOKENS tokens over at most FEW_CELLS placed cells (a decode step's) has
# its mask made in Python lists (kq_mask_list): fewer NumPy calls, each of which costs tens of
# microseconds on the caches a decode step's weights have just flushed; larger ones in NumPy
FEW_TOKENS = 8
FEW_CELLS = 1024
NEG_INF = float("-inf")


def kq_mask_list(kv: KVCache, ub, n_kv: int, n_rows: int, causal: bool = True) -> list:
    """kq_mask_values' mask, flat in memory order (row by row), as a Python list."""
    cells = kv.cells
    n = min(n_kv, cells.hi)
    pos, seqs = cells.pos[:n], cells.seq[:n]
    tail = [NEG_INF] * (n_kv - n)
    out = []
    for i in range(ub.n_tokens):
        s, p = ub.seq_id[i][0], int(ub.pos[i]) if causal else float("inf")
        out += [0.0 if 0 <= q <= p and s in ids else NEG_INF for q, ids in zip(pos, seqs)]
        out += tail
    return out + [NEG_INF] * (n_kv * (n_rows - ub.n_tokens))


def build_attn_inp_kv(g, kv: KVCache, causal: bool = True) -> InputAttnKV:
    """The inputs of every attention layer of the graph (built once per graph)."""
    n_tokens = g.n_tokens
    ctx = g.ctx0
    k_idxs = ctx.new_tensor_1d(mg.i64, n_tokens).set_name("inp_k_idxs").set_input()
    # one v_idxs per V width (a cache of K-only layers, MLA, has none)
    v_idxs = {w: ctx.new_tensor_1d(mg.i64, n_tokens * w).set_name("inp_v_idxs" if len(kv.v_widths) == 1
                                                                   else f"inp_v_idxs_{w}").set_input()
              for w in kv.v_widths}
    mask = ctx.new_tensor_2d(mg.f32, kv.n_kv, pad_to(n_tokens, GGML_KQ_MASK_PAD)).set_name("inp_kq_mask").set_input()
    inp = InputAttnKV(kv, k_idxs, v_idxs, mask, causal)
    g.res.inputs.append(inp)
    return inp


def cpy_k(kv: KVCache, k_cur: mg.Tensor, k_idxs: mg.Tensor, il: int) -> mg.Tensor:
    """Store k_cur [n_embd_k, n_tokens] into the K rows of the ubatch's cells."""
    k_cur = mg.reshape_2d(k_cur, kv.n_embd_k[il], k_cur.nelements() // kv.n_embd_k[il])
    return mg.set_rows(kv.k_l[il], k_cur, k_idxs).set_name(f"cache_k_l{il}_store")


def cpy_v(kv: KVCache, v_cur: mg.Tensor, v_idxs: mg.Tensor, il: int) -> mg.Tensor:
    """Store v_cur [n_embd_v, n_tokens] into the transposed V: every element is a one-float row
    of the flattened cache, placed by v_idxs."""
    v = kv.v_l[il]
    n = v_cur.nelements()
    v_cur = mg.reshape_2d(v_cur, 1, n)
    v_view = mg.reshape_2d(v, 1, v.nelements())
    return mg.set_rows(v_view, v_cur, v_idxs).set_name(f"cache_v_l{il}_store")


def get_k(kv: KVCache, il: int, n_head_kv: int) -> mg.Tensor:
    """Keys of cells [0, n_kv): [n_embd_head_k, n_head_kv, n_kv]."""
    k = kv.k_l[il]
    d = kv.n_embd_k[il] // n_head_kv
    return mg.view_3d(k, d, n_head_kv, kv.n_kv, d * k.type.size, k.nb[1], 0)


def get_v(kv: KVCache, il: int, n_head_kv: int) -> mg.Tensor:
    """Values of cells [0, n_kv) from the transposed layout: [n_kv, n_head_kv, n_embd_head_v]."""
    v = kv.v_l[il]
    d = kv.n_embd_v[il] // n_head_kv
    elt = v.type.size
    return mg.view_3d(v, kv.n_kv, n_head_kv, d, kv.size * d * elt, kv.size * elt, 0)


def build_attn(g, inp: InputAttnKV, q_cur, k_cur, v_cur, n_head: int, n_head_kv: int, scale: float,
               il: int) -> mg.Tensor:
    """Store this ubatch's K/V, then attend over the cache (llama.cpp's build_attn with the KV
    cache and build_attn_mha without flash attention). q_cur [d, n_head, n_tokens], k_cur /
    v_cur [d, n_head_kv, n_tokens]. Returns [d_v * n_head, n_tokens].

    GQA (n_head a multiple of n_head_kv) needs no repeat: mul_mat broadcasts its first operand
    over dim 2, so query head h reads K/V head h // (n_head / n_head_kv), as ggml does."""
    if n_head % n_head_kv:
        raise ValueError(f"attention layer {il}: n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    kv = inp.kv
    n_tokens = q_cur.ne[2]
    g.gf.build_forward_expand(cpy_k(kv, k_cur, inp.self_k_idxs, il))
    g.gf.build_forward_expand(cpy_v(kv, v_cur, inp.self_v_idxs[kv.n_embd_v[il]], il))
    q = mg.permute(q_cur, 0, 2, 1, 3)                                # [d, n_tokens, n_head]
    k = mg.permute(get_k(kv, il, n_head_kv), 0, 2, 1, 3)             # [d, n_kv, n_head_kv]
    v = mg.permute(get_v(kv, il, n_head_kv), 0, 2, 1, 3)             # [n_kv, d_v, n_head_kv]
    kq = mg.mul_mat(k, q)                                            # [n_kv, n_tokens, n_head]
    kq = mg.soft_max_ext(kq, inp.self_kq_mask, scale, 0.0).set_name(f"kq_soft_max_l{il}")
    kqv = mg.mul_mat(v, kq)                                          # [d_v, n_tokens, n_head]
    cur = mg.permute(kqv, 0, 2, 1, 3)                                # [d_v, n_head, n_tokens]
    return mg.cont_2d(cur, cur.ne[0] * n_head, n_tokens)


def build_attn_k(g, inp: InputAttnKV, q_cur, k_cur, v_width: int, v_mla: mg.Tensor, scale: float,
                 il: int) -> mg.Tensor:
    """Attention over a K-only cache layer (llama.cpp's build_attn with llm_graph_input_attn_k, as
    MLA with the absorbed projections uses it), flash attention off. q_cur [D, n_head, n_tokens],
    k_cur [D, 1, n_tokens]: one shared K head; the values are the first v_width channels of each
    cached key (a view, nothing else stored); v_mla [v_width, d_v, n_head] turns each head's
    attended values back into its own d_v channels. Returns [d_v * n_head, n_tokens]."""
    kv = inp.kv
    n_tokens = q_cur.ne[2]
    g.gf.build_forward_expand(cpy_k(kv, k_cur, inp.self_k_idxs, il))
    k_all = get_k(kv, il, 1)                                         # [D, 1, n_kv]
    v = mg.view_3d(k_all, v_width, 1, kv.n_kv, k_all.nb[1], k_all.nb[2], 0)   # [v_width, 1, n_kv]
    q = mg.permute(q_cur, 0, 2, 1, 3)                                # [D, n_tokens, n_head]
    k = mg.permute(k_all, 0, 2, 1, 3)                                # [D, n_kv, 1]
    v = mg.cont(mg.transpose(mg.permute(v, 0, 2, 1, 3)))             # [n_kv, v_width, 1]
    kq = mg.mul_mat(k, q)                                            # [n_kv, n_tokens, n_head]
    kq = mg.soft_max_ext(kq, inp.self_kq_mask, scale, 0.0).set_name(f"kq_soft_max_l{il}")
    kqv = mg.mul_mat(v, kq)                                          # [v_width, n_tokens, n_head]
    kqv = mg.mul_mat(v_mla, kqv)                                     # [d_v, n_tokens, n_head]
    cur = mg.permute(kqv, 0, 2, 1, 3)                                # [d_v, n_head, n_tokens]
    return mg.cont_2d(cur, cur.ne[0] * cur.ne[1], n_tokens)
