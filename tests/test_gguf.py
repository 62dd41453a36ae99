"""GGUF files (models/gguf_io.py): llama.cpp's arch names, metadata keys, tensor names and shapes;
write a tiny model, read it back, same logits bit for bit. Needs the `gguf`
package, which the test extra installs: without it these tests fail (they never skip)."""
import importlib

import numpy as np
import pytest

import gguf

import minigraph as mg
from minigraph.models.gguf_io import GGUFError, load_gguf, model_class, read_metadata, save_gguf
from minigraph.models.kda import KDAModel
from minigraph.models.lfm import LFM2Model
from minigraph.models.runner import Runner

@pytest.fixture(autouse=True)
def one_cpu_thread():
    """One thread per cpu device: same bits, and no spinning OpenMP barriers when other
    processes share the cores."""
    devs = [mg.backend("cpu:0"), mg.backend("cpu:1")]
    saved = [d.n_threads for d in devs]
    for d in devs:
        d.set_n_threads(1)
    yield
    for d, n in zip(devs, saved):
        d.n_threads = n


# vocab != d_model so that a transposed matrix cannot pass for the right one
# lfm2 conv-only (head_count_kv zeros; LFM2Model's default has an attention block, whose files
# tests/test_model_lfm_hybrid.py round-trips)
LFM_CFG = dict(n_vocab=48, n_embd=64, n_layer=2, l_cache=3, n_ff=96, head_count_kv=[0, 0])
KDA_CFG = dict(n_vocab=48, n_embd=64, n_layer=2, n_head=2, head_dim=16, d_conv=4, n_ff=96, head_count_kv=[0, 0])
STREAM = [{0: [1, 2, 3, 4, 5]}, {0: [6]}, {0: [7, 8], 1: [9, 10]}, {0: [11], 1: [12]}]


def make(kind, devices, seed=3):
    if kind == "lfm2":
        return LFM2Model(**LFM_CFG, devices=devices, seed=seed)
    return KDAModel(**KDA_CFG, devices=devices, seed=seed)


def run(model, n_rs_seq=2):
    r = Runner(model, mem_size=2, n_rs_seq=n_rs_seq)
    logits = [r.decode_seq_tokens(step) for step in STREAM]
    state = [t.numpy() for il in model.layers for t in (r.memory.r_l.get(il), r.memory.s_l.get(il)) if t is not None]
    kv = getattr(r.memory, "kv", None)           # a hybrid's attention blocks: their K/V too
    state += [t.numpy() for t in (kv.tensors() if kv else [])]
    return logits, state


def assert_same_run(a, b):
    (la, sa), (lb, sb) = a, b
    for x, y in zip(la, lb):
        for s in x:
            assert np.array_equal(x[s], y[s]), "logits differ"
    for x, y in zip(sa, sb):
        assert np.array_equal(x, y), "state differs"


@pytest.mark.parametrize("kind", ["lfm2", "kimi-linear"])
@pytest.mark.parametrize("embed_hparams", [True, False])
def test_round_trip_same_logits_bit_for_bit(tmp_path, kind, embed_hparams):
    cpu = mg.backend("cpu")
    m = make(kind, cpu)
    path = save_gguf(m, tmp_path / f"{kind}.gguf", embed_hparams=embed_hparams)
    back = load_gguf(path, devices=cpu)
    assert type(back) is type(m) and back.hparams == m.hparams
    for name, t in m.gguf_tensors().items():
        assert np.array_equal(back.gguf_tensors()[name].numpy(), t.numpy()), name
    assert_same_run(run(m), run(back))


@pytest.mark.parametrize("kind", ["lfm2", "kimi-linear"])
def test_load_onto_two_devices(tmp_path, kind):
    d1, d0 = mg.backend("cpu:1"), mg.backend("cpu:0")
    m = make(kind, d0)
    back = load_gguf(save_gguf(m, tmp_path / "m.gguf"), devices=[d1, d0])
    for name, t in back.gguf_tensors().items():
        assert t.backend is (d1 if name.startswith("blk.0.") else d0), name
    assert_same_run(run(m), run(back))


def test_lfm2_metadata_and_tensor_shapes(tmp_path):
    m = make("lfm2", mg.backend("cpu"))
    path = save_gguf(m, tmp_path / "lfm.gguf")
    kv = read_metadata(path)
    assert kv["general.architecture"] == "lfm2" and kv["tokenizer.ggml.model"] == "none"
    assert kv["lfm2.vocab_size"] == 48 and kv["lfm2.embedding_length"] == 64
    assert kv["lfm2.block_count"] == 2 and kv["lfm2.shortconv.l_cache"] == 3
    assert kv["lfm2.feed_forward_length"] == 96
    assert list(kv["lfm2.attention.head_count_kv"]) == [0, 0]          # 0 = short-conv block
    assert kv["lfm2.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    ne = {t.name: tuple(int(x) for x in t.shape) for t in gguf.GGUFReader(str(path)).tensors}
    assert ne == {
        "token_embd.weight": (64, 48), "token_embd_norm.weight": (64,), "output.weight": (64, 48),
        **{f"blk.{i}.{k}": v for i in range(2) for k, v in {
            "attn_norm.weight": (64,), "shortconv.in_proj.weight": (64, 192),
            "shortconv.conv.weight": (3, 64), "shortconv.out_proj.weight": (64, 64),
            "ffn_norm.weight": (64,), "ffn_gate.weight": (64, 96), "ffn_up.weight": (64, 96),
            "ffn_down.weight": (96, 64)}.items()}}
    # data orientation: row t of the NumPy array is token t's embedding (ne0 fastest)
    rt = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["token_embd.weight"]
    assert np.array_equal(rt.data, m.gguf_tensors()["token_embd.weight"].numpy())
    assert rt.data.shape == (48, 64)


def test_kimi_linear_metadata_and_tensor_shapes(tmp_path):
    m = make("kimi-linear", mg.backend("cpu"))
    path = save_gguf(m, tmp_path / "kda.gguf")
    kv = read_metadata(path)
    a = "kimi-linear."
    assert kv["general.architecture"] == "kimi-linear" and kv["tokenizer.ggml.model"] == "none"
    assert kv[a + "attention.head_count"] == 2 and list(kv[a + "attention.head_count_kv"]) == [0, 0]
    assert kv[a + "kda.head_dim"] == 16 and kv[a + "ssm.conv_kernel"] == 4
    assert kv[a + "leading_dense_block_count"] == 2 and kv[a + "feed_forward_length"] == 96
    for k in ("expert_feed_forward_length", "expert_shared_count", "expert_gating_func"):
        assert a + k in kv
    ne = {t.name: tuple(int(x) for x in t.shape) for t in gguf.GGUFReader(str(path)).tensors}
    assert ne["token_embd.weight"] == (64, 48) and ne["output_norm.weight"] == (64,)
    assert ne["output.weight"] == (64, 48)
    want = {"attn_norm.weight": (64,), "attn_q.weight": (64, 32), "attn_k.weight": (64, 32),
            "attn_v.weight": (64, 32), "ssm_conv1d_q.weight": (4, 1, 32), "ssm_conv1d_k.weight": (4, 1, 32),
            "ssm_conv1d_v.weight": (4, 1, 32), "ssm_f_a.weight": (64, 16), "ssm_f_b.weight": (16, 32),
            "ssm_dt.bias": (32,), "ssm_a": (1, 2), "ssm_beta.weight": (64, 2), "ssm_g_a.weight": (64, 16),
            "ssm_g_b.weight": (16, 32), "ssm_norm.weight": (16,), "attn_output.weight": (32, 64),
            "ffn_norm.weight": (64,), "ffn_gate.weight": (64, 96), "ffn_up.weight": (64, 96),
            "ffn_down.weight": (96, 64)}
    for i in range(2):
        for k, v in want.items():
            assert ne.pop(f"blk.{i}.{k}") == v, k
    assert set(ne) == {"token_embd.weight", "output_norm.weight", "output.weight"}


def test_tied_output_falls_back_to_the_embedding(tmp_path):
    cpu = mg.backend("cpu")
    m = make("lfm2", cpu)
    m.output.set(m.tok_embd.numpy())
    path = save_gguf(m, tmp_path / "tied.gguf", tie_output=True)
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert_same_run(run(m), run(load_gguf(path, devices=cpu)))
    with pytest.raises(GGUFError, match="tie_output"):
        save_gguf(make("lfm2", cpu), tmp_path / "bad.gguf", tie_output=True)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(GGUFError, match="unsupported GGUF architecture 'rwkv7'"):
        model_class("rwkv7")
    # a file whose tensor has another shape than the model built from its metadata expects
    m = make("lfm2", mg.backend("cpu"))
    path = save_gguf(m, tmp_path / "m.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "lfm2")
    for k, v in read_metadata(path).items():
        if k.startswith("lfm2."):
            if isinstance(v, list):
                w.add_key_value(k, v, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
            elif isinstance(v, float):
                w.add_float32(k, v)
            else:
                w.add_uint32(k, v)
    for t in gguf.GGUFReader(str(path)).tensors:
        arr = np.array(t.data)
        if t.name == "blk.1.shortconv.conv.weight":
            arr = arr[:, :2].copy()                        # kernel 2 instead of 3
        w.add_tensor(t.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"blk.1.shortconv.conv.weight: shape in file ne=\[2, 64\]"):
        load_gguf(tmp_path / "bad.gguf", devices=mg.backend("cpu"))


def _other(module, cls):
    return getattr(importlib.import_module(module), cls)(devices=mg.backend("cpu"), seed=1)


@pytest.mark.parametrize("arch,module,cls", [("mamba2", "minigraph.models.mamba2", "Mamba2Model"),
                                             ("qwen35", "minigraph.models.delta_net", "DeltaNetModel")])
def test_other_archs_round_trip_generically(tmp_path, arch, module, cls):
    m = _other(module, cls)
    cpu = mg.backend("cpu")
    path = save_gguf(m, tmp_path / f"{arch}.gguf")
    kv = read_metadata(path)
    assert kv["general.architecture"] == arch and kv[f"{arch}.block_count"] == len(m.layers)
    back = load_gguf(path, devices=cpu)
    assert type(back) is type(m)
    assert_same_run(run(m), run(back))
