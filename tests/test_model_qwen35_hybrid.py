"""qwen35 with gated attention blocks (models/delta_net.py with full_attention_interval, llama.cpp's
layout: block il is attention when (il + 1) % interval == 0): logits against the sequential NumPy
reference (prefill, decode, two sequences in one batch, several layouts, GQA, partial rope),
drafts rolled back, the ref and cpu backends, GGUF round trips (unknown keys kept), bad files
refused in one line before any weight is read, and the command line."""
import json
import subprocess
import sys

import numpy as np
import pytest

import minigraph as mg
from minigraph.models.delta_net import DeltaNetHybridModel, DeltaNetModel
from minigraph.models.gguf_io import GGUFError, load_gguf, read_metadata, save_gguf
from minigraph.models.hybrid_memory import HybridMemory
from minigraph.models.runner import Runner

from refs import check
from refs.delta_net_hybrid_ref import DeltaNetHybridRef
from gguf_rewrite import rewrite_gguf

LAYOUTS = {                 # name -> constructor arguments beyond model()'s
    "every-2nd": dict(n_layer=4, full_attention_interval=2),
    "llama.cpp-like": dict(n_layer=4, full_attention_interval=4),
    "all-attn-mqa": dict(n_layer=2, full_attention_interval=1, n_head_kv=1),
    "partial-rope": dict(n_layer=3, full_attention_interval=3, attn_head_dim=16, n_rot=8, rope_sections=[1, 1, 1, 1]),
}


def model(devices=None, layout="every-2nd", seed=0, **kw):
    args = dict(n_vocab=40, n_embd=32, head_dim=8, num_k_heads=2, num_v_heads=4, n_ff=48, n_head=4, n_head_kv=2)
    args.update(LAYOUTS[layout])
    args.update(kw)
    return DeltaNetModel(devices=devices, seed=seed, **args)


def runner(m=None, **kw):
    kw.setdefault("mem_size", 4)
    kw.setdefault("n_rs_seq", 3)
    kw.setdefault("n_ubatch", 8)
    kw.setdefault("kv_size", 64)
    return Runner(m or model(), **kw)


def run_ref(ref, seq, toks):
    return ref.run(seq, toks)[0]


def test_attention_blocks_follow_llama_cpp_rule_and_get_a_hybrid_memory():
    m = model()
    assert m.attn_layers == (1, 3)
    assert [m.n_embd_s(il) for il in range(4)] == [256, 0, 256, 0]
    assert m.n_embd_k_gqa(1) == 16 and m.n_embd_k_gqa(0) == 0
    names = m.gguf_tensors()
    assert names["blk.1.attn_q.weight"].ne[:2] == (32, 64)          # q and gate: 2 * head_dim * n_head
    assert "blk.1.attn_qkv.weight" not in names and "blk.0.attn_q.weight" not in names
    r = runner(m)
    assert isinstance(r.memory, HybridMemory)
    assert r.memory.kv.layers == [1, 3] and r.memory.recurrent.layers == [0, 2]
    assert DeltaNetHybridModel().attn_layers == (3,)
    # the default is hybrid as llama.cpp's files are (2 blocks: delta-net, attention); 0: none
    assert DeltaNetModel().attn_layers == (1,) and DeltaNetModel(n_layer=1).attn_layers == ()
    assert DeltaNetModel(n_layer=8).attn_layers == (3, 7)
    assert DeltaNetModel(full_attention_interval=0).attn_layers == ()


def test_delta_net_l2_norm_is_llama_cpps():
    """rms_norm(x, eps/n) / sqrt(n) = x / sqrt(sum x^2 + eps): differs from ggml_l2_norm for small x."""
    from minigraph.models.delta_net import build_gdn_l2_norm
    ctx = mg.Context()
    x = ctx.new_tensor_1d(mg.f32, 4)
    y = build_gdn_l2_norm(x, 1e-2).set_output()
    gf = mg.Graph()
    gf.build_forward_expand(y)
    be = mg.backend("cpu")
    mg.alloc_ctx_tensors(ctx, be)
    v = np.array([0.01, -0.02, 0.03, 0.0], np.float32)
    x.set(v)
    be.graph_compute(gf)
    want = v / np.sqrt(np.sum(v.astype(np.float64) ** 2) + 1e-2)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5)
    assert not np.allclose(want, v / max(np.linalg.norm(v), 1e-2), rtol=1e-2)      # ggml_l2_norm's


@pytest.mark.parametrize("device", ["ref", "cpu"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prefill_decode_two_sequences_match_the_reference(device, layout):
    r = runner(model(mg.backend(device), layout, seed=3))
    ref = DeltaNetHybridRef.from_model(r.model)
    what = f"{layout}/{device}"
    out = r.decode_seq_tokens({0: [1, 2, 3, 4, 5], 1: [7, 8, 9]})
    check("qwen35-hybrid", f"prefill {what}", out[0], run_ref(ref, 0, [1, 2, 3, 4, 5]))
    check("qwen35-hybrid", f"prefill {what}", out[1], run_ref(ref, 1, [7, 8, 9]))
    for a, b in (([6], [10]), ([11, 12], [13, 14]), ([15], [16]), ([17, 18, 19], [20, 21, 22])):
        out = r.decode_seq_tokens({0: a, 1: b})
        check("qwen35-hybrid", f"decode {what}", out[0], run_ref(ref, 0, a))
        check("qwen35-hybrid", f"decode {what}", out[1], run_ref(ref, 1, b))


def test_long_prefill_over_several_ubatches_matches_the_reference():
    r = runner(n_ubatch=5)
    ref = DeltaNetHybridRef.from_model(r.model)
    toks = [int(t) for t in np.arange(23) * 7 % 40]
    check("qwen35-hybrid", "long prefill", r.decode_seq_tokens({0: toks})[0], run_ref(ref, 0, toks))


@pytest.mark.parametrize("layout", ["every-2nd", "partial-rope"])
def test_drafts_rolled_back_match_the_reference(layout):
    r = runner(model(layout=layout, seed=5))
    ref = DeltaNetHybridRef.from_model(r.model)
    check("qwen35-hybrid", "draft prefill", r.decode_seq_tokens({0: [1, 2, 3, 4]})[0], run_ref(ref, 0, [1, 2, 3, 4]))
    for draft, n_accept in (([5, 6, 7], 1), ([8, 9], 2), ([10, 11, 12, 13], 2), ([14], 1)):
        got = r.speculative_step(0, draft, n_accept)
        check("qwen35-hybrid", "drafts", got, run_ref(ref, 0, draft[:n_accept]))
        assert r.memory.kv.seq_pos_max(0) == r.memory.recurrent.seq_pos_max(0)
    assert r.stats.rollbacks == 2
    check("qwen35-hybrid", "after drafts", r.decode_seq_tokens({0: [3]})[0], run_ref(ref, 0, [3]))


def test_ref_and_cpu_backends_agree():
    toks = {0: [3, 1, 4, 1, 5], 1: [9, 2, 6]}
    a = runner(model(mg.backend("ref"), seed=7)).decode_seq_tokens(toks)
    b = runner(model(mg.backend("cpu"), seed=7)).decode_seq_tokens(toks)
    for s in toks:
        check("qwen35-hybrid", "ref vs cpu", b[s], a[s])


# -- GGUF -----------------------------------------------------------------------------------------

def logits_of(m):
    return Runner(m, mem_size=2, kv_size=32).decode_seq_tokens({0: [1, 2, 3, 4], 1: [5, 6]})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gguf_round_trip_llama_cpp_keys_only(tmp_path, layout):
    cpu = mg.backend("cpu")
    m = model(cpu, layout, seed=2, rope_freq_base=5000.0)
    path = save_gguf(m, tmp_path / "h.gguf", embed_hparams=False)      # only llama.cpp's keys
    kv = read_metadata(path)
    assert kv["qwen35.full_attention_interval"] == m.full_attention_interval
    assert kv["qwen35.attention.head_count"] == 4 and kv["qwen35.rope.freq_base"] == 5000.0
    assert list(kv["qwen35.rope.dimension_sections"]) == m.rope_sections
    back = load_gguf(path, devices=cpu)
    assert back.attn_layers == m.attn_layers and back.n_rot == m.n_rot and back.rope_sections == m.rope_sections
    a, b = logits_of(m), logits_of(back)
    for s in a:
        assert np.array_equal(a[s], b[s])


def test_a_file_without_attention_blocks_still_loads_as_recurrent_only(tmp_path):
    cpu = mg.backend("cpu")
    m = DeltaNetModel(n_vocab=40, n_embd=32, head_dim=8, n_ff=48, full_attention_interval=0, devices=cpu, seed=1)
    back = load_gguf(save_gguf(m, tmp_path / "r.gguf", embed_hparams=False), devices=cpu)
    assert back.attn_layers == ()
    a, b = logits_of(m), logits_of(back)
    for s in a:
        assert np.array_equal(a[s], b[s])


def _rewrite(src, dst, **edits):
    return rewrite_gguf(src, dst, "qwen35", **edits)


def test_unknown_keys_are_kept_on_a_round_trip(tmp_path):
    import gguf
    T = gguf.GGUFValueType
    cpu = mg.backend("cpu")
    src = save_gguf(model(cpu), tmp_path / "a.gguf")
    f = _rewrite(src, tmp_path / "b.gguf", extra=[("qwen35.vocab_extra", 7, T.UINT64, None),
                                                  ("general.license", "mit", T.STRING, None)])
    back = load_gguf(f, devices=cpu)
    kv = read_metadata(save_gguf(back, tmp_path / "c.gguf"))
    assert kv["qwen35.vocab_extra"] == 7 and kv["general.license"] == "mit"
    assert kv["qwen35.full_attention_interval"] == 2


def test_recurrent_layers_array_is_read_like_llama_cpp(tmp_path):
    import gguf
    T = gguf.GGUFValueType
    cpu = mg.backend("cpu")
    src = save_gguf(model(cpu), tmp_path / "a.gguf", embed_hparams=False)
    f = _rewrite(src, tmp_path / "b.gguf", kv_edit=lambda k, v: None if k == "qwen35.full_attention_interval" else v,
                 extra=[("qwen35.attention.recurrent_layers", [True, False, True, False], T.ARRAY, T.BOOL)])
    assert load_gguf(f, devices=cpu).attn_layers == (1, 3)
    bad = _rewrite(src, tmp_path / "c.gguf", extra=[("qwen35.attention.recurrent_layers", [False, True, True, False],
                                                     T.ARRAY, T.BOOL)])
    with pytest.raises(GGUFError, match=r"attention at blocks \[0, 3\], expected every k-th block"):
        load_gguf(bad, devices=cpu)


@pytest.mark.parametrize("key,value,match", [
    ("qwen35.attention.head_count", 3, r"head_count 3 must be a multiple of attention.head_count_kv 2"),
    ("qwen35.attention.value_length", 4, r"value_length = 4, expected key_length 8"),
    ("qwen35.rope.dimension_count", 7, r"rope.dimension_count = 7, expected even and in \(0, key_length 8\]"),
    ("qwen35.rope.dimension_sections", [1, 1], r"rope.dimension_sections = \[1, 1\], expected 4 entries"),
    ("qwen35.full_attention_interval", 0, r"full_attention_interval = 0, expected > 0"),
    ("qwen35.ssm.inner_size", 30, r"ssm.inner_size = 30, expected ssm.state_size \* ssm.time_step_rank = 32"),
])
def test_bad_keys_are_one_line_errors_before_any_weight_is_read(tmp_path, monkeypatch, key, value, match):
    src = save_gguf(model(mg.backend("cpu")), tmp_path / "a.gguf", embed_hparams=False)
    bad = _rewrite(src, tmp_path / "bad.gguf", kv_edit=lambda k, v: value if k == key else v)
    import gguf
    read = []
    real = gguf.ReaderTensor.__getattribute__

    def spy(self, attr):
        if attr == "data":
            read.append(real(self, "name"))
        return real(self, attr)
    monkeypatch.setattr(gguf.ReaderTensor, "__getattribute__", spy)
    with pytest.raises(GGUFError, match=match) as e:
        load_gguf(bad, devices=mg.backend("cpu"))
    assert "\n" not in str(e.value) and read == []


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    cpu = mg.backend("cpu")
    src = save_gguf(model(cpu), tmp_path / "a.gguf", embed_hparams=False)
    bad = _rewrite(src, tmp_path / "bad.gguf",
                   kv_edit=lambda k, v: 8 if k == "qwen35.attention.head_count" else v)   # q is then too small
    with pytest.raises(GGUFError, match=r"blk.1.attn_q.weight: shape in file ne=\[32, 64\]"):
        load_gguf(bad, devices=cpu)


# -- command line ---------------------------------------------------------------------------------

def cli(*args):
    return subprocess.run([sys.executable, "-m", "minigraph", *args], capture_output=True, text=True, timeout=300)


def test_cli_runs_the_hybrid_and_passes_its_state_check():
    p = cli("run", "delta-net-hybrid", "--steps", "12", "--n-rs-seq", "3", "--draft", "4", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout)
    assert out["state_check"] == "pass" and out["rollbacks"] > 0


def test_cli_runs_a_hybrid_gguf_file(tmp_path):
    path = save_gguf(model(mg.backend("cpu")), tmp_path / "h.gguf")
    p = cli("run", "--gguf", str(path), "--steps", "6", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout)["state_check"] == "pass"
