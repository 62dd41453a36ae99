"""LFM2 with attention blocks (llama.cpp's hybrid layout: short-conv blocks keep their state in the
recurrent memory, attention blocks their K/V in the KV cache): logits against the sequential NumPy
reference (prefill, decode, two sequences in one batch, several layer patterns, GQA), drafts
rolled back, the ref and cpu backends, GGUF round trips (any layer pattern, unknown keys kept),
bad files refused in one line before any weight is read, and the command line."""
import json
import subprocess
import sys

import numpy as np
import pytest

import minigraph as mg
from minigraph.models.gguf_io import HPARAMS_KEY, GGUFError, load_gguf, read_metadata, save_gguf
from minigraph.models.hybrid_memory import HybridMemory
from minigraph.models.lfm import LFM2HybridModel, LFM2Model
from minigraph.models import zoo
from minigraph.models.runner import Runner

from refs import check
from refs.lfm_hybrid_ref import LfmHybridRef
from gguf_rewrite import rewrite_gguf

PATTERNS = {                       # per-layer head_count_kv: 0 = short conv
    "conv-attn-conv": [0, 2, 0],
    "attn-first": [2, 0, 0, 2],
    "mostly-attn": [4, 0, 4],
    "all-attn": [4, 4],
    "attn-last-mqa": [0, 0, 1],
    "mixed-kv-heads": [2, 0, 4, 1],          # per-layer K/V head counts differ: K/V widths 16, 32, 8
}


def model(devices=None, pattern=(0, 2, 0), seed=0, **kw):
    return LFM2Model(n_vocab=40, n_embd=32, n_layer=len(pattern), l_cache=3, n_ff=48, n_head=4,
                     head_count_kv=list(pattern), devices=devices, seed=seed, **kw)


def runner(m=None, **kw):
    kw.setdefault("mem_size", 4)
    kw.setdefault("n_rs_seq", 3)
    kw.setdefault("n_ubatch", 8)
    kw.setdefault("kv_size", 64)
    return Runner(m or model(), **kw)


def test_attention_layers_follow_head_count_kv_and_get_a_hybrid_memory():
    m = model(pattern=[2, 0, 0, 2])
    assert m.attn_layers == (0, 3) and m.head_dim == 8
    assert [m.n_embd_r(il) for il in range(4)] == [0, 64, 64, 0]
    assert m.n_embd_k_gqa(0) == 16 and m.n_embd_v_gqa(3) == 16 and m.n_embd_k_gqa(1) == 0
    names = m.gguf_tensors()
    for n in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm"):
        assert f"blk.0.{n}.weight" in names and f"blk.1.{n}.weight" not in names
    assert names["blk.0.attn_k.weight"].ne[:2] == (32, 16) and names["blk.0.attn_q_norm.weight"].ne[0] == 8
    r = runner(m)
    assert isinstance(r.memory, HybridMemory)
    assert r.memory.kv.layers == [0, 3] and r.memory.recurrent.layers == [1, 2]


def test_default_lfm_has_llama_cpp_style_attention_blocks():
    """LFM2Model's default is llama.cpp's hybrid layout (every llama.cpp LFM2 file has attention
    blocks); LFM2HybridModel and the zoo's lfm-hybrid are aliases; a conv-only LFM2 is an explicit
    head_count_kv of zeros."""
    m = LFM2Model(n_layer=6)
    assert m.head_count_kv == [0, 2, 0, 0, 2, 0] and m.attn_layers == (1, 4)
    d = LFM2Model()
    assert d.n_layer == 3 and d.head_count_kv == [0, 2, 0] and d.attn_layers == (1,)
    assert LFM2HybridModel is LFM2Model
    assert zoo.model_class("lfm") is zoo.model_class("lfm-hybrid") is LFM2Model
    assert isinstance(Runner(zoo.make_model("lfm", [mg.backend("ref")])).memory, HybridMemory)
    assert LFM2Model(head_count_kv=[0, 0, 0]).attn_layers == ()


@pytest.mark.parametrize("device", ["ref", "cpu"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_prefill_decode_two_sequences_match_the_reference(device, pattern):
    r = runner(model(mg.backend(device), PATTERNS[pattern], seed=3))
    ref = LfmHybridRef(r.model)
    what = f"{pattern}/{device}"
    out = r.decode_seq_tokens({0: [1, 2, 3, 4, 5], 1: [7, 8, 9]})
    check("lfm2-hybrid", f"prefill {what}", out[0], ref.run(0, [1, 2, 3, 4, 5]))
    check("lfm2-hybrid", f"prefill {what}", out[1], ref.run(1, [7, 8, 9]))
    for a, b in (([6], [10]), ([11, 12], [13, 14]), ([15], [16]), ([17, 18, 19], [20, 21, 22])):
        out = r.decode_seq_tokens({0: a, 1: b})
        check("lfm2-hybrid", f"decode {what}", out[0], ref.run(0, a))
        check("lfm2-hybrid", f"decode {what}", out[1], ref.run(1, b))


def test_long_prefill_over_several_ubatches_matches_the_reference():
    r = runner(n_ubatch=5)
    ref = LfmHybridRef(r.model)
    toks = [int(t) for t in np.arange(23) * 7 % 40]
    check("lfm2-hybrid", "long prefill", r.decode_seq_tokens({0: toks})[0], ref.run(0, toks))


@pytest.mark.parametrize("pattern", ["conv-attn-conv", "attn-first"])
def test_drafts_rolled_back_match_the_reference(pattern):
    r = runner(model(pattern=PATTERNS[pattern], seed=5))
    ref = LfmHybridRef(r.model)
    check("lfm2-hybrid", "draft prefill", r.decode_seq_tokens({0: [1, 2, 3, 4]})[0], ref.run(0, [1, 2, 3, 4]))
    for draft, n_accept in (([5, 6, 7], 1), ([8, 9], 2), ([10, 11, 12, 13], 2), ([14], 1)):
        got = r.speculative_step(0, draft, n_accept)
        check("lfm2-hybrid", "drafts", got, ref.run(0, draft[:n_accept]))
        assert r.memory.kv.seq_pos_max(0) == r.memory.recurrent.seq_pos_max(0)
    assert r.stats.rollbacks == 2
    check("lfm2-hybrid", "after drafts", r.decode_seq_tokens({0: [3]})[0], ref.run(0, [3]))


def test_a_copied_sequence_sees_the_shared_prefix():
    r = runner()
    ref = LfmHybridRef(r.model)
    r.decode_seq_tokens({0: [1, 2, 3]})
    ref.run(0, [1, 2, 3])
    r.memory.seq_cp(0, 2)
    ref.copy_seq(0, 2)
    out = r.decode_seq_tokens({0: [4], 2: [9]})
    check("lfm2-hybrid", "seq_cp", out[0], ref.run(0, [4]))
    check("lfm2-hybrid", "seq_cp", out[2], ref.run(2, [9]))


def test_ref_and_cpu_backends_agree():
    toks = {0: [3, 1, 4, 1, 5], 1: [9, 2, 6]}
    a = runner(model(mg.backend("ref"), seed=7)).decode_seq_tokens(toks)
    b = runner(model(mg.backend("cpu"), seed=7)).decode_seq_tokens(toks)
    for s in toks:
        check("lfm2-hybrid", "ref vs cpu", b[s], a[s])


def test_layers_on_two_devices_match_the_reference():
    cpu0, cpu1 = mg.backend("cpu:0"), mg.backend("cpu:1")
    r = runner(model([cpu0, cpu1, cpu1]))
    ref = LfmHybridRef(r.model)
    assert r.memory.kv.k_l[1].backend is cpu1
    out = r.decode_seq_tokens({0: [1, 2, 3], 1: [4, 5]})
    check("lfm2-hybrid", "two devices", out[0], ref.run(0, [1, 2, 3]))
    check("lfm2-hybrid", "two devices", out[1], ref.run(1, [4, 5]))


# -- GGUF -----------------------------------------------------------------------------------------

def logits_of(m):
    return Runner(m, mem_size=2, kv_size=32).decode_seq_tokens({0: [1, 2, 3, 4], 1: [5, 6]})


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_gguf_round_trip_any_layer_pattern(tmp_path, pattern):
    cpu = mg.backend("cpu")
    m = model(cpu, PATTERNS[pattern], seed=2, rope_freq_base=5000.0)
    path = save_gguf(m, tmp_path / "h.gguf", embed_hparams=False)      # only llama.cpp's keys
    kv = read_metadata(path)
    assert list(kv["lfm2.attention.head_count_kv"]) == PATTERNS[pattern]
    assert kv["lfm2.attention.head_count"] == 4 and kv["lfm2.rope.freq_base"] == 5000.0
    back = load_gguf(path, devices=cpu)
    assert back.head_count_kv == PATTERNS[pattern] and back.rope_freq_base == 5000.0
    a, b = logits_of(m), logits_of(back)
    for s in a:
        assert np.array_equal(a[s], b[s])


def _rewrite(src, dst, **edits):
    return rewrite_gguf(src, dst, "lfm2", **edits)


def test_unknown_keys_are_kept_on_a_round_trip(tmp_path):
    import gguf
    T = gguf.GGUFValueType
    cpu = mg.backend("cpu")
    src = save_gguf(model(cpu), tmp_path / "a.gguf")
    f = _rewrite(src, tmp_path / "b.gguf", extra=[("lfm2.vocab_extra", 7, T.UINT64, None),
                                                  ("general.license", "mit", T.STRING, None),
                                                  ("lfm2.some_list", [1.5, 2.5], T.ARRAY, T.FLOAT32)])
    back = load_gguf(f, devices=cpu)
    out = save_gguf(back, tmp_path / "c.gguf")
    kv = read_metadata(out)
    assert kv["lfm2.vocab_extra"] == 7 and kv["general.license"] == "mit" and kv["lfm2.some_list"] == [1.5, 2.5]
    assert gguf.GGUFReader(str(out)).fields["lfm2.vocab_extra"].types[0] == T.UINT64
    assert list(kv["lfm2.attention.head_count_kv"]) == [0, 2, 0]


@pytest.mark.parametrize("key,value,match", [
    ("lfm2.attention.head_count_kv", [0, 2], r"head_count_kv has 2 entries, expected one per block \(block_count 3\)"),
    ("lfm2.attention.head_count_kv", [0, 3, 0], r"lfm2.attention.head_count_kv\[1\] = 3, expected 0 \(short conv\) or a divisor of lfm2.attention.head_count 4"),
    ("lfm2.attention.head_count", 5, r"lfm2.attention.head_count 5 must divide lfm2.embedding_length 32"),
    ("lfm2.shortconv.l_cache", 1, r"lfm2.shortconv.l_cache = 1, expected > 1"),
])
def test_bad_heads_and_patterns_are_one_line_errors(tmp_path, key, value, match):
    src = save_gguf(model(mg.backend("cpu")), tmp_path / "a.gguf", embed_hparams=False)
    bad = _rewrite(src, tmp_path / "bad.gguf", kv_edit=lambda k, v: value if k == key else v)
    with pytest.raises(GGUFError, match=match) as e:
        load_gguf(bad, devices=mg.backend("cpu"))
    assert "\n" not in str(e.value)


def test_a_missing_key_is_named(tmp_path):
    src = save_gguf(model(mg.backend("cpu")), tmp_path / "a.gguf", embed_hparams=False)
    bad = _rewrite(src, tmp_path / "bad.gguf",
                   kv_edit=lambda k, v: None if k == "lfm2.shortconv.l_cache" else v)
    with pytest.raises(GGUFError, match="metadata key lfm2.shortconv.l_cache is missing"):
        load_gguf(bad, devices=mg.backend("cpu"))


@pytest.mark.parametrize("name,cut", [("blk.1.attn_k.weight", 8), ("blk.1.attn_q_norm.weight", 4)])
def test_a_tensor_of_the_wrong_shape_is_named_before_any_weight_is_read(tmp_path, monkeypatch, name, cut):
    cpu = mg.backend("cpu")
    src = save_gguf(model(cpu), tmp_path / "a.gguf", embed_hparams=False)
    bad = _rewrite(src, tmp_path / "bad.gguf",
                   tensor_edit=lambda n, a: a[..., :cut].copy() if n == name else a)
    import gguf
    read = []
    real = gguf.ReaderTensor.__getattribute__

    def spy(self, attr):
        if attr == "data":
            read.append(real(self, "name"))
        return real(self, attr)
    monkeypatch.setattr(gguf.ReaderTensor, "__getattribute__", spy)
    with pytest.raises(GGUFError, match=rf"{name}: shape in file ne=\[{cut}"):
        load_gguf(bad, devices=cpu)
    assert read == []                    # no tensor's data was touched


# -- command line ---------------------------------------------------------------------------------

def cli(*args):
    return subprocess.run([sys.executable, "-m", "minigraph", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["lfm", "lfm-hybrid"])
def test_cli_runs_the_hybrid_and_passes_its_state_check(name):
    p = cli("run", name, "--steps", "12", "--n-rs-seq", "3", "--draft", "4", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout)
    assert out["state_check"] == "pass" and out["rollbacks"] > 0


def test_cli_placement_and_reuse_of_the_default_lfm():
    """placement over two CPUs shows the attention block's K/V stores in a split of its layer's
    device (block 1 of 3 on cpu:0); reuse's validator passes."""
    p = cli("placement", "lfm", "--devices", "cpu:0,cpu:1")
    assert p.returncode == 0, p.stdout + p.stderr
    splits = [line for line in p.stdout.splitlines() if line.startswith("## SPLIT")]
    kv_split = next(i for i, line in enumerate(p.stdout.splitlines()) if "cache_k_l1_store" in line)
    header = max(i for i, line in enumerate(p.stdout.splitlines()[:kv_split]) if line.startswith("## SPLIT"))
    assert splits and ": cpu:0 #" in p.stdout.splitlines()[header]
    assert "cache_v_l1_store" in p.stdout.splitlines()[kv_split]
    p = cli("reuse", "lfm")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "validator: pass" in p.stdout


def test_cli_placement_summarises_kv_stores_and_masks_per_device():
    """One line per K/V store (its device and the index input it reads, copied or not) and per
    mask read, as the conv stores have; the JSON carries the same (kv_stores, kq_masks)."""
    p = cli("placement", "lfm", "--devices", "cpu:1,cpu:0", "--layers", "6")
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [line.split() for line in p.stdout.splitlines() if line.startswith(("  cache_", "  kq_mask"))]
    stores = {x[0]: x for x in lines if x[0].startswith(("cache_k_l", "cache_v_l"))}
    assert set(stores) == {"cache_k_l1", "cache_v_l1", "cache_k_l4", "cache_v_l4"}
    assert stores["cache_k_l1"][3] == "cpu:1" and stores["cache_k_l4"][3] == "cpu:0"
    assert "copied as cpu:1#inp_k_idxs#0" in " ".join(stores["cache_k_l1"])      # the index input lives on the host
    assert " ".join(stores["cache_k_l4"]).endswith("from cpu:0, not copied")
    masks = [x for x in lines if x[0] == "kq_mask"]
    assert [m[3] for m in masks] == ["cpu:1", "cpu:0"] and masks[0][5] == "kq_soft_max_l1:"
    out = json.loads(cli("placement", "lfm", "--devices", "cpu:1,cpu:0", "--layers", "6", "--json").stdout)
    assert [k["tensor"] for k in out["kv_stores"]] == ["cache_k_l1", "cache_v_l1", "cache_k_l4", "cache_v_l4"]
    assert [(m["device"], m["mask"]["copied"]) for m in out["kq_masks"]] == [("cpu:1", True), ("cpu:0", False)]


@pytest.mark.parametrize("pattern", ["conv-attn-conv", "attn-first"])
def test_cli_runs_a_hybrid_gguf_file(tmp_path, pattern):
    path = save_gguf(model(mg.backend("cpu"), PATTERNS[pattern]), tmp_path / "h.gguf")
    p = cli("run", "--gguf", str(path), "--steps", "6", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout)["state_check"] == "pass"


def test_a_file_in_llama_cpps_converter_layout_loads_and_runs(tmp_path):
    """The keys and names llama.cpp's converter writes (token_embd_norm as the final norm, a tied
    head with no output.weight, a gpt2 tokenizer section, no minigraph.hparams): load_gguf gives
    the model's own logits, the tokenizer keys survive a save, and `minigraph run lfm --gguf`
    runs the file with its state check passing."""
    from llama_layout import tie_output, write_lfm2_as_llama_cpp
    cpu = mg.backend("cpu")
    m = model(cpu, PATTERNS["mixed-kv-heads"])
    tie_output(m)
    path = write_lfm2_as_llama_cpp(m, tmp_path / "conv.gguf")
    kv = read_metadata(path)
    assert "output.weight" not in {t.name for t in __import__("gguf").GGUFReader(path).tensors}
    assert HPARAMS_KEY not in kv and kv["tokenizer.ggml.model"] == "gpt2"
    back = load_gguf(path, devices=cpu)
    a, b = logits_of(m), logits_of(back)
    for s in a:
        assert np.array_equal(a[s], b[s])
    again = read_metadata(save_gguf(back, tmp_path / "again.gguf"))
    assert again["tokenizer.ggml.pre"] == "lfm2" and len(again["tokenizer.ggml.tokens"]) == 40
    p = cli("run", "lfm", "--gguf", path, "--steps", "6", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout)["state_check"] == "pass"
