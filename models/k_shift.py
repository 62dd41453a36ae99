"""The K shift of a rope model's KV cache (llama.cpp's llama_kv_cache::update with a pending
shift): seq_add / seq_div move cells to new positions and only record the distance (each cell's
`shift`); before the next graph, every cached key is re-rotated by its cell's distance, so it is
the key a token at the new position would have stored. Rope is a rotation by position, so
rotating by the difference composes with the rotation already in the cache.

A model takes part through two attributes:
- `k_shift = "rope"`: its attention layers rotate K; `rope_shift(k, shift, il)` returns layer il's
  rotated keys for the view k [n_rot, n_head_kv, kv_size] at the per-cell distances shift [kv_size];
- `k_shift = None`: no rope on K (kimi-linear's MLA): a shift only renumbers the cells;
- `k_shift = "refuse"`: a rope llama.cpp cannot shift (qwen35's multi-section rope: llama.cpp aborts
  on a pending shift); seq_add / seq_div are refused before anything changes.

The graph here is built per shift (one happens rarely); it runs on the model's devices, each
layer's keys rotated where they live, then the cells' distances are cleared."""
from __future__ import annotations

import numpy as np

import minigraph as mg


class KShiftRefused(ValueError):
    """seq_add / seq_div on a model whose cached keys cannot be re-rotated."""


def check_can_shift(model, what: str) -> None:
    """Raise KShiftRefused (one line) when a position change of `what` could not be applied to
    the model's cached keys, before anything changes."""
    if getattr(model, "k_shift", None) == "refuse" and getattr(model, "attn_layers", ()):
        raise KShiftRefused(f"{what}: {model.arch} cannot move cached positions: its keys carry a "
                            "multi-section rope, which llama.cpp does not re-rotate (it aborts on "
                            "such a K shift); remove and re-decode the positions instead")


def apply_k_shift(model, kv, backends) -> bool:
    """Re-rotate the cached keys by the cells' pending distances and clear them (llama.cpp's
    update before the next graph). Returns True when a graph ran."""
    if kv is None or not kv.cells.has_shift:
        return False
    ran = False
    if getattr(model, "k_shift", None) == "rope":
        ctx = mg.Context()
        shift = ctx.new_tensor_1d(mg.i32, kv.size).set_name("inp_k_shift").set_input()
        gf = mg.Graph()
        for il in kv.layers:
            k = kv.k_l[il]
            n_rot, n_head_kv, d = model.k_shift_dims(il)
            view = mg.view_3d(k, n_rot, n_head_kv, kv.size, d * k.type.size, k.nb[1], 0)
            rotated = model.rope_shift(view, shift, il)
            gf.build_forward_expand(mg.cpy(rotated, view).set_name(f"k_shift_l{il}"))
        sched = mg.Scheduler(backends)
        sched.alloc_graph(gf)
        cells = kv.cells
        shift.set(np.array([0 if cells.is_empty(i) else cells.shift[i] for i in range(kv.size)], np.int32))
        sched.graph_compute(gf)
        ran = True
    kv.cells.shift = [0] * kv.size
    kv.cells.has_shift = False
    return ran
