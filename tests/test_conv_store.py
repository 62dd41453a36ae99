"""The conv-state store's invariant as a property: after the conv-state store of a ubatch of n tokens,
slot j < min(n, K) of each sequence's cell holds conv_x[n-j : n-j+n_cols] per channel (at byte
offset offs of the row), and every other byte of the state keeps its guard value."""
import numpy as np
from hypothesis import given, strategies as st

import minigraph as mg
from minigraph.models.conv_state import conv_state_store


@st.composite
def store_cases(draw):
    n_rs_seq = draw(st.integers(0, 4))
    n_cols = draw(st.integers(1, 4))
    channels = draw(st.integers(1, 4))
    n_seqs = draw(st.integers(1, 3))
    mem_size = draw(st.integers(n_seqs, n_seqs + 2))
    head = draw(st.integers(0, mem_size - n_seqs))
    n = draw(st.integers(1, 6))
    parts = draw(st.integers(1, 3))              # KDA-like rows of several parts
    part = draw(st.integers(0, parts - 1))
    device = draw(st.sampled_from(["ref", "cpu"]))
    seed = draw(st.integers(0, 2**16))
    return n_rs_seq, n_cols, channels, n_seqs, mem_size, head, n, parts, part, device, seed


@given(store_cases())
def test_conv_store_writes_exactly_the_windows(case):
    n_rs_seq, n_cols, ch, n_seqs, mem, head, n, parts, part, device, seed = case
    rng = np.random.default_rng(seed)
    K = n_rs_seq + 1
    be = mg.backend(device)
    row = parts * n_cols * ch
    offs = part * n_cols * ch * 4
    ctx = mg.Context()
    s = ctx.new_tensor_2d(mg.f32, row, mem * K)
    conv_x = ctx.new_tensor_3d(mg.f32, n_cols + n, ch, n_seqs)
    gf = mg.Graph()
    conv_state_store(gf, s, conv_x, n_cols, offs, head, mem, n_rs_seq)
    mg.alloc_ctx_tensors(ctx, be, usage="any")
    guard = rng.uniform(-9, -1, (mem * K, row)).astype(np.float32)     # never zero, never data
    x = rng.uniform(1, 9, (n_seqs, ch, n_cols + n)).astype(np.float32)
    s.set(guard)
    conv_x.set(x)
    be.graph_compute(gf)
    got = s.numpy()
    want = guard.copy()
    written = min(n, K) if n_rs_seq > 0 else 1
    for j in range(written):
        for q in range(n_seqs):
            window = x[q, :, n - j: n - j + n_cols]                       # [ch, n_cols]
            want[j * mem + head + q, part * n_cols * ch:(part + 1) * n_cols * ch] = window.reshape(-1)
    assert got.tobytes() == want.tobytes()
