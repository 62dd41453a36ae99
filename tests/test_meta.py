"""The meta device (backends/meta): one logical device split over cpu:0 and cpu:1 — slices,
scatter/gather, graph expansion with all-reduces, the toy conv model decoding with rollback
(caches r_l split on axis 0 by channel) equal to a single-device run, and the split report."""
import json

import numpy as np
import pytest

import minigraph as mg
from minigraph.backends.meta import MetaBackend, recipe_for, split_by_name
from minigraph.models.toy_tp import ToyConvTPModel
from minigraph.backends.meta.split_state import SplitState
from minigraph.models.runner import Runner
from minigraph.models.toy import ToyConvModel

RTOL = 1e-6


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.fixture
def cpus():
    return mg.backend("cpu:0"), mg.backend("cpu:1")


def test_device_names():
    m = mg.backend("meta(cpu:0, cpu:1)")
    assert m is mg.backend("meta(cpu:0,cpu:1)")
    assert m.name == "meta(cpu:0,cpu:1)" and [d.name for d in m.devices] == ["cpu:0", "cpu:1"]
    assert mg.backend("meta(cpu,cpu:1)") is m                  # cpu == cpu:0
    for bad in ("meta()", "meta(cpu:0", "meta(cpu:0,cpu:0)"):
        with pytest.raises(ValueError):
            mg.backend(bad)
    from minigraph.models.zoo import parse_devices
    assert [d.name for d in parse_devices("meta(cpu:0,cpu:1),cpu:0")] == ["meta(cpu:0,cpu:1)", "cpu:0"]


def test_set_and_numpy_scatter_and_gather(cpus):
    rng = np.random.default_rng(0)
    seg = SplitState.segmented(0, [(2, 1), (1, 2)])          # e.g. fused [q | k]: 3 + 3 rows
    meta = MetaBackend(list(cpus) + [mg.backend("cpu:2")], split_by_name({
        "a0": 0, "a1": (1, 2), "a2": 2, "seg": lambda t, n: SplitState.segmented(0, [(2, 1, 1), (1, 2, 1)])}))
    ctx = mg.Context()
    ts = {n: ctx.new_tensor(mg.f32, ne).set_name(n) for n, ne in
          [("a0", (7, 3)), ("a1", (4, 6, 2)), ("a2", (2, 3, 5)), ("m", (5, 2)), ("seg", (8, 3))]}
    buf = mg.alloc_ctx_tensors(ctx, meta)
    data = {n: rng.standard_normal(t.shape).astype(np.float32) for n, t in ts.items()}
    for n, t in ts.items():
        t.set(data[n])
    for n, t in ts.items():
        assert np.array_equal(t.numpy(), data[n]), n
    # device slices: a0 is split 3/2/2 along ne0 -> device 1 holds columns 3..4 of every row
    st = meta.states.state(ts["a0"])
    assert st.shares() == (3, 2, 2)
    sl = meta._simple(ts["a0"], 1, {})
    assert sl.ne == (2, 3, 1, 1) and np.array_equal(cpus[1].read_tensor(sl)[0, 0], data["a0"][:, 3:5])
    # two segments: device 0 holds rows {0,1 | 4}, device 1 {2 | 5,6}, device 2 {3 | 7}
    sl = meta._simple(ts["seg"], 1, {})
    assert np.array_equal(cpus[1].read_tensor(sl)[0, 0], data["seg"][:, [2, 5, 6]])
    # raw bytes (what the recurrent memory's snapshots use) are the logical bytes
    t = ts["a1"]
    raw = meta.get_bytes(buf, t.offs, t.nbytes())
    assert raw.tobytes() == data["a1"].tobytes()
    new = rng.standard_normal(t.shape).astype(np.float32)
    meta.set_bytes(buf, t.offs + 8, new.view(np.uint8).reshape(-1)[8:])
    want = data["a1"].copy().reshape(-1)
    want[2:] = new.reshape(-1)[2:]
    assert np.array_equal(t.numpy().reshape(-1), want)
    assert np.array_equal(ts["a2"].numpy(), data["a2"])       # neighbours untouched


def test_set_split_state_reslices_stored_tensors(cpus):
    meta = MetaBackend(cpus)
    ctx = mg.Context()
    w = ctx.new_tensor_2d(mg.f32, 6, 4).set_name("w")
    mg.alloc_ctx_tensors(ctx, meta)
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    w.set(x)
    assert meta.states.state(w).axis == 10
    meta.set_split_state(split_by_name({"w": 0}))
    assert meta.states.state(w).shares() == (3, 3)
    assert np.array_equal(w.numpy(), x)
    assert np.array_equal(cpus[1].read_tensor(meta._simple(w, 1, {}))[0, 0], x[:, 3:])


def test_graph_with_an_all_reduce_matches_cpu(cpus):
    rng = np.random.default_rng(1)
    W1 = rng.standard_normal((6, 8)).astype(np.float32)
    W2 = rng.standard_normal((8, 6)).astype(np.float32)
    X = rng.standard_normal((3, 8)).astype(np.float32)
    outs = {}
    for name, dev in [("cpu", cpus[0]), ("meta", MetaBackend(cpus, split_by_name({"w1": 1, "w2": 0})))]:
        ctx = mg.Context()
        w1 = ctx.new_tensor_2d(mg.f32, 8, 6).set_name("w1")
        w2 = ctx.new_tensor_2d(mg.f32, 6, 8).set_name("w2")
        x = ctx.new_tensor_2d(mg.f32, 8, 3).set_name("x").set_input()
        mg.alloc_ctx_tensors(ctx, dev)
        w1.set(W1), w2.set(W2), x.set(X)
        y = mg.mul_mat(w2, mg.silu(mg.mul_mat(w1, x))).set_name("y")
        gf = mg.Graph().build_forward_expand(y)
        dev.graph_compute(gf)
        outs[name] = y.numpy()
        if name == "meta":
            assert dev.last_allreduces == ["y"]
            rep = dev.split_report(gf)
            assert rep["all_reduces"] == ["y"]
            assert {r["tensor"]: r["state"] for r in rep["tensors"]}["w1"] == "AXIS_1 {3,3}"
            assert "all-reduces per step: 1: y" in dev.format_split_report(gf)
    assert rel_err(outs["meta"], outs["cpu"]) <= RTOL


STREAM = [{0: [1, 2, 3, 4, 5], 1: [7, 8, 9, 10, 11]}, {0: [6], 1: [12]}, "spec", {0: [13], 1: [14]},
          {0: [3, 4], 1: [5, 6]}, "spec", {0: [15], 1: [16]}, {0: [17], 1: [18]}, {0: [19], 1: [20]}]


def decode(model, backends=None, validate=False):
    r = Runner(model, mem_size=4, n_rs_seq=2, n_ubatch=4, backends=backends, validate=validate)
    outs = []
    for step in STREAM:
        if step == "spec":                     # a draft of 3, one accepted: roll back 2 tokens
            outs.append(r.speculative_step(0, [3, 9, 5], 1))
        else:
            outs += list(r.decode_seq_tokens(step).values())
    caches = {t.name: t.numpy() for t in r.memory.tensors()}
    return outs, caches, r


def toy_tp(dev, **kw):
    return ToyConvTPModel(n_vocab=24, n_embd=8, n_layer=2, d_conv=4, devices=dev, seed=0, **kw)


@pytest.mark.parametrize("layout", ["meta", "meta+host", "meta3"])
def test_toy_decode_with_rollback_on_meta_matches_cpu(cpus, layout):
    want_logits, want_caches, _ = decode(toy_tp(cpus[0]))
    devs = list(cpus) + ([mg.backend("cpu:2")] if layout == "meta3" else [])
    meta = MetaBackend(devs)
    model = toy_tp(meta)
    meta.set_split_state(recipe_for(model))
    backends = [meta, cpus[0]] if layout == "meta+host" else None
    logits, caches, r = decode(model, backends, validate=layout == "meta")
    for a, b in zip(logits, want_logits):
        assert rel_err(a, b) <= RTOL
    for k in want_caches:
        assert rel_err(caches[k], want_caches[k]) <= RTOL, k
    st = meta.states.state(r.memory.r_l[0])
    assert st.axis == 0 and st.shares() == ((12, 12) if layout != "meta3" else (9, 9, 6))
    assert meta.n_allreduce > 0 and len(meta.last_allreduces) == 2     # one per layer and step
    if layout == "meta":
        assert r.stats.validated > 0 and r.stats.reuses > 0
    if layout == "meta+host":   # the inputs live on the host and are copied in, mirrored
        rep = r.prev.sched.placement_report()
        assert {c.dst_device for c in rep.copies} == {meta.name}
    rep = meta.split_report(r.prev.gf, r.prev.sched)
    rules = {row["rule"] for row in rep["tensors"]}
    assert any(x.startswith("view 4: permuted view") for x in rules)       # slots
    assert any(x.startswith("view 3:") for x in rules)                     # windows


def test_plain_toy_mirrored_is_bit_exact_and_split_cache_fails_clearly(cpus):
    want_logits, want_caches, _ = decode(ToyConvModel(n_vocab=24, n_embd=8, devices=cpus[0]))
    meta = MetaBackend(cpus)
    logits, caches, _ = decode(ToyConvModel(n_vocab=24, n_embd=8, devices=meta))
    assert all(np.array_equal(a, b) for a, b in zip(logits, want_logits))
    assert all(np.array_equal(caches[k], want_caches[k]) for k in caches)
    # the plain toy has no output projection: a layer output split by channel meets the
    # MIRRORED residual stream in an ADD, which no rule allows
    model = ToyConvModel(n_vocab=24, n_embd=8, devices=meta)
    assert recipe_for(model) is None
    meta.set_split_state(split_by_name({r"cache_r_l\d+": (0, 3), r"blk\.\d+\.(in_proj|conv)": 1, r"blk\.\d+\.norm": 0}))
    with pytest.raises(mg.OpError, match=r"split state of ADD .*rule 'binary broadcast' failed: sources disagree"):
        decode(model)


def test_cli_placement_reports_split_states(capsys):
    from minigraph.cli import main
    try:
        assert main(["placement", "toy-tp", "--devices", "meta(cpu:0,cpu:1)", "--json", "--n-rs-seq", "2"]) == 0
        out = json.loads(capsys.readouterr().out)
        rep = out["split_states"][0]
        assert rep["device"] == "meta(cpu:0,cpu:1)" and len(rep["all_reduces"]) == 2
        rows = {r["tensor"]: r for r in rep["tensors"]}
        assert rows["cache_r_l0"]["state"] == "AXIS_0 {24,24}" and rows["cache_r_l0"]["rule"] == "leaf: callback"
        assert rows["logits"]["state"] == "MIRRORED"
        assert main(["placement", "toy-tp", "--devices", "meta(cpu:0,cpu:1)"]) == 0
        text = capsys.readouterr().out
        assert "split states on meta(cpu:0,cpu:1)" in text and "all-reduces per step: 2" in text
    finally:
        mg.backend("meta(cpu:0,cpu:1)").set_split_state(None)


def test_delta_net_split_by_heads_decodes_with_rollback_like_cpu(cpus):
    """Qwen 3.5 gated delta-net split by k heads as llama.cpp does (q|k|v one segment of key_dim
    repeated 2 + Hv/Hk times): GATED_DELTA_NET, the conv store and the state store run split,
    with one all-reduce per mixer and per FFN."""
    from minigraph.models.delta_net import DeltaNetModel
    pure = dict(full_attention_interval=0)          # delta-net blocks only: the split under test
    want_logits, want_caches, _ = decode(DeltaNetModel(devices=cpus[0], seed=0, **pure))
    meta = MetaBackend(cpus)
    model = DeltaNetModel(devices=meta, seed=0, **pure)
    meta.set_split_state(recipe_for(model))
    logits, caches, r = decode(model)
    for a, b in zip(logits, want_logits):
        assert rel_err(a, b) <= RTOL
    for k in want_caches:
        assert rel_err(caches[k], want_caches[k]) <= RTOL, k
    assert str(meta.states.state(r.memory.s_l[0])) == "AXIS_0 {[256,256]x2}"
    assert len(meta.last_allreduces) == 2 * model.n_layer
    rows = {row["op"]: row for row in meta.split_report(r.prev.gf, r.prev.sched)["tensors"]}
    assert rows["GATED_DELTA_NET"]["state"] == "AXIS_0 {32,32}"


def test_mamba2_runs_mirrored_and_kda_rows_refuse_a_split(cpus):
    """Mamba-2 has no head split under ggml's rules (SSM_SCAN is scalar-only; B and C share the
    conv channel axis with x): on a meta device it runs MIRRORED, bit for bit like cpu. KDA packs
    three histories per r row: a split r cache is refused with the permuted-view rule's error."""
    from minigraph.models.kda import KDAModel
    from minigraph.models.mamba2 import Mamba2Model
    kw = dict(n_embd=32, d_inner=64, n_head=4, seed=0)
    want_logits, want_caches, _ = decode(Mamba2Model(devices=cpus[0], **kw))
    meta = MetaBackend(cpus)
    model = Mamba2Model(devices=meta, **kw)
    assert recipe_for(model) is None
    logits, caches, _ = decode(model)
    assert all(np.array_equal(a, b) for a, b in zip(logits, want_logits))
    assert all(np.array_equal(caches[k], want_caches[k]) for k in caches)
    meta = MetaBackend(cpus, split_by_name({r"cache_r_l\d+": 0}))
    with pytest.raises(mg.OpError, match=r"rule 'view 4: permuted view' failed.*"
                                         r"source 'cache_r_l0' is split on axis 0"):
        decode(KDAModel(devices=meta, seed=0))


def test_concat_of_a_mirrored_and_a_split_source(cpus):
    """concat(MIRRORED, AXIS_1) is split on axis 1: each device concatenates its channels of the
    whole source (ggml passes the whole tensor, whose kernel would read channels from 0)."""
    rng = np.random.default_rng(2)
    A = rng.standard_normal((2, 8, 3)).astype(np.float32)      # [3, 8, 2] in ne order
    B = rng.standard_normal((2, 8, 5)).astype(np.float32)
    meta = MetaBackend(cpus, split_by_name({"b": lambda t, n: SplitState.split(1, (5, 3))}))
    ctx = mg.Context()
    a = ctx.new_tensor_3d(mg.f32, 3, 8, 2).set_name("a")
    b = ctx.new_tensor_3d(mg.f32, 5, 8, 2).set_name("b")
    mg.alloc_ctx_tensors(ctx, meta)
    a.set(A), b.set(B)
    y = mg.silu(mg.concat(a, b, 0))
    gf = mg.Graph().build_forward_expand(y)
    meta.graph_compute(gf)
    assert str(meta.states.state(y)) == "AXIS_1 {5,3}"
    want = np.concatenate([A, B], axis=2)
    assert rel_err(y.numpy(), want / (1 + np.exp(-want))) <= RTOL


def test_a_device_with_an_empty_slice_adds_nothing(cpus):
    """Device 1 holds no rows of w1 and no columns of w2: its partial sum is left out of the
    all-reduce (ggml clears its COMPUTE flag) and it still ends with the whole result."""
    rng = np.random.default_rng(3)
    W1 = rng.standard_normal((6, 8)).astype(np.float32)
    W2 = rng.standard_normal((8, 6)).astype(np.float32)
    X = rng.standard_normal((3, 8)).astype(np.float32)
    meta = MetaBackend(list(cpus) + [mg.backend("cpu:2")], split_by_name({
        "w1": lambda t, n: SplitState.split(1, (4, 0, 2)), "w2": lambda t, n: SplitState.split(0, (4, 0, 2))}))
    ctx = mg.Context()
    w1 = ctx.new_tensor_2d(mg.f32, 8, 6).set_name("w1")
    w2 = ctx.new_tensor_2d(mg.f32, 6, 8).set_name("w2")
    x = ctx.new_tensor_2d(mg.f32, 8, 3).set_name("x").set_input()
    mg.alloc_ctx_tensors(ctx, meta)
    w1.set(W1), w2.set(W2), x.set(X)
    y = mg.mul_mat(w2, mg.silu(mg.mul_mat(w1, x))).set_name("y")
    gf = mg.Graph().build_forward_expand(y)
    meta.graph_compute(gf)
    h = X @ W1.T
    want = (h / (1 + np.exp(-h))) @ W2.T
    assert rel_err(y.numpy(), want) <= RTOL
    assert np.array_equal(mg.backend("cpu:1").read_tensor(meta._simple(y, 1, {})).reshape(3, 8), y.numpy())
