"""Mamba-2 (models/mamba2.py) and the Qwen3.5-style gated delta-net (models/delta_net.py) against
their sequential NumPy references (tests/refs/mamba2_ref.py, tests/refs/delta_net_ref.py): logits,
each layer's output and every written state slot (rel err <= 1e-5) for prefill, decode and
two-sequence ubatches with n_rs_seq in {0, 1, 3}; rollback integrity (speculative steps against a
run that only saw the accepted tokens) on one device and on two CPUs under every slot order; graph
reuse and its validator. The two models share every scenario; only their configs differ."""
import numpy as np
import pytest

import minigraph as mg
from minigraph.models.delta_net import DeltaNetModel
from minigraph.models.graph import SLOT_ORDERS
from minigraph.models.mamba2 import Mamba2Model
from minigraph.models.runner import Runner
from refs import cache_arrays, decode_and_check, rollback_scenario
from refs.delta_net_ref import DeltaNetRef
from refs.mamba2_ref import Mamba2Ref

N_VOCAB = 64

# kind -> (tiny config, independent reference)
KINDS = {
    "mamba2": (lambda devices, seed, n_layer, **kw: Mamba2Model(
        n_vocab=N_VOCAB, n_embd=64, n_layer=n_layer, d_conv=4, d_inner=128, d_state=16, n_head=8,
        n_group=2, devices=devices, seed=seed, layer_outputs=True, **kw), Mamba2Ref),
    "delta-net": (lambda devices, seed, n_layer, **kw: DeltaNetModel(
        n_vocab=N_VOCAB, n_embd=64, n_layer=n_layer, d_conv=4, head_dim=16, num_k_heads=2,
        num_v_heads=4, n_ff=128, full_attention_interval=0,     # delta-net blocks only (the reference's)
        devices=devices, seed=seed, layer_outputs=True, **kw), DeltaNetRef),
}


def model(kind, devices="cpu", seed=0, n_layer=2, **kw):
    if isinstance(devices, str):
        devices = mg.backend(devices)
    elif isinstance(devices, (list, tuple)) and isinstance(devices[0], str):
        devices = [mg.backend(d) for d in devices]
    return KINDS[kind][0](devices, seed, n_layer, **kw)


def test_mamba2_config_and_state_sizes():
    m = model("mamba2", "ref")
    assert (m.head_dim, m.conv_channels, m.d_in_proj) == (16, 192, 2 * 128 + 2 * 2 * 16 + 8)
    assert m.n_embd_r(0) == 3 * 192 and m.n_embd_s(0) == 16 * 128
    assert m.gguf_tensors()["blk.1.ssm_in.weight"].ne == (64, m.d_in_proj, 1, 1)
    assert m.gguf_tensors()["blk.0.ssm_a"].ne == (1, 8, 1, 1) and np.all(m.gguf_tensors()["blk.0.ssm_a"].numpy() < 0)
    assert m.gguf_tensors()["blk.0.ssm_norm.weight"].ne == (64, 2, 1, 1)


def test_delta_net_config_and_state_sizes():
    m = model("delta-net", "ref")
    assert (m.key_dim, m.value_dim, m.conv_channels) == (32, 64, 128)
    assert m.n_embd_r(0) == 3 * 128 and m.n_embd_s(0) == 16 * 16 * 4
    assert m.gguf_tensors()["blk.0.attn_qkv.weight"].ne == (64, 128, 1, 1)
    assert m.gguf_tensors()["blk.1.ssm_conv1d.weight"].ne == (4, 128, 1, 1)
    assert m.gguf_tensors()["blk.0.ssm_a"].ne == (4, 1, 1, 1) and np.all(m.gguf_tensors()["blk.0.ssm_a"].numpy() < 0)
    assert m.gguf_tensors()["blk.0.post_attention_norm.weight"].ne == (64, 1, 1, 1)


STREAM = [{0: [1, 2, 3, 4, 5], 1: [7, 8, 9, 10, 11]},     # prefill, two sequences in one ubatch
          {0: [6], 1: [12]}, {0: [13], 1: [14]},            # decode
          {0: [15]},                                         # one sequence
          {0: [3, 4], 1: [5, 6]},                            # two tokens each
          {1: [40, 41, 42, 43, 44, 45]},                     # prefill of one sequence
          {0: [16], 1: [17]}]


@pytest.mark.parametrize("device", ["ref", "cpu"])
@pytest.mark.parametrize("n_rs_seq", [0, 1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(kind, device, n_rs_seq):
    m = model(kind, device, seed=n_rs_seq)
    ref = KINDS[kind][1].from_model(m)
    r = Runner(m, mem_size=3, n_rs_seq=n_rs_seq, n_ubatch=16)
    for step in STREAM:
        decode_and_check(r, ref, step)


@pytest.mark.parametrize("device", ["ref", "cpu"])
@pytest.mark.parametrize("kind", KINDS)
def test_prompt_split_across_ubatches_matches_reference(kind, device):
    """A 9-token prompt in ubatches of at most 5 (the last K tokens kept together)."""
    m = model(kind, device, seed=5)
    ref = KINDS[kind][1].from_model(m)
    r = Runner(m, mem_size=2, n_rs_seq=2, n_ubatch=5)
    decode_and_check(r, ref, {0: list(range(20, 29))}, one_ubatch=False)
    assert r.stats.ubatches >= 2
    decode_and_check(r, ref, {0: [1]})


@pytest.mark.parametrize("device,seed", [("ref", s) for s in range(10)] + [("cpu", s) for s in range(6)])
@pytest.mark.parametrize("kind", KINDS)
def test_rollback_equals_decoding_only_the_accepted_tokens(kind, device, seed):
    m = model(kind, device, seed=seed)
    ref = KINDS[kind][1].from_model(m)
    rollback_scenario(lambda k: Runner(m, mem_size=2, n_rs_seq=k), ref, seed, N_VOCAB)


@pytest.mark.parametrize("slot_order", SLOT_ORDERS)
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("kind", KINDS)
def test_rollback_with_layers_on_two_cpus(kind, slot_order, seed):
    """Three layers: 0 on cpu:1, 1 and 2 on cpu:0 (the host)."""
    m = model(kind, ["cpu:1", "cpu:0", "cpu:0"], seed=seed, n_layer=3)
    ref = KINDS[kind][1].from_model(m)
    rollback_scenario(lambda k: Runner(m, mem_size=2, n_rs_seq=k, slot_order=slot_order),
                      ref, 100 + seed, N_VOCAB, n_rs_seq=3)


@pytest.mark.parametrize("kind", KINDS)
def test_two_cpus_equal_one_cpu(kind):
    one, two = model(kind, "cpu", n_layer=3), model(kind, ["cpu:1", "cpu:0", "cpu:0"], n_layer=3)
    ra, rb = Runner(one, mem_size=2, n_rs_seq=2), Runner(two, mem_size=2, n_rs_seq=2)
    for step in STREAM[:3]:
        a, b = ra.decode_seq_tokens(step), rb.decode_seq_tokens(step)
        for s in step:
            assert np.array_equal(a[s], b[s])
    ca, cb = cache_arrays(ra), cache_arrays(rb)
    for k in ca:
        assert np.array_equal(ca[k], cb[k])


@pytest.mark.parametrize("device", ["ref", "cpu"])
@pytest.mark.parametrize("n_rs_seq", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_graph_reuse_and_validator(kind, device, n_rs_seq):
    stream = ([{0: [1, 2, 3, 4], 1: [5, 6, 7, 8]}] + [{0: [9 + i], 1: [20 + i]} for i in range(4)]
              + [{0: [30, 31], 1: [32, 33]}, {0: [34], 1: [35]}, {0: [36], 1: [37]}])
    runs = {}
    for reuse in (True, False):
        r = Runner(model(kind, device), mem_size=2, n_rs_seq=n_rs_seq, reuse=reuse, validate=reuse)
        runs[reuse] = ([r.decode_seq_tokens(s) for s in stream], cache_arrays(r), r.stats)
    (l_on, c_on, st_on), (l_off, c_off, st_off) = runs[True], runs[False]
    for a, b in zip(l_on, l_off):
        for s in a:
            assert np.array_equal(a[s], b[s])
    for k in c_on:
        assert np.array_equal(c_on[k], c_off[k])
    # a rebuild exactly when the ubatch shape changes: 2x4, 2x1 (reused 3 times), 2x2, 2x1 (reused once)
    assert (st_on.builds, st_on.reuses) == (4, 4)
    assert st_on.validated == st_on.reuses
    assert st_off.reuses == 0 and st_off.builds == len(stream)
