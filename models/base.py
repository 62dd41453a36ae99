"""What the recurrent models (mamba2, delta_net, lfm, kda and the toy) share: devices per layer,
seeded weights made on their device, GGUF names, and the whole-model graph around a per-model
mixer:

    tokens -> get_rows(tok_embd)                                          [n_embd, n_tokens]
    per layer il: RMS norm x attn_norm -> build_layer(g, inp_rs, cur, il) -> residual add
                  [-> RMS norm x ffn_norm -> SwiGLU FFN -> residual add]  (layers with ffn_norm)
    -> rows wanted (out_ids) -> RMS norm x out_norm -> output head -> 'logits'   [n_vocab, n_outputs]

A model subclasses RecurrentModel: it passes its `hparams` (structural constructor arguments,
what models.gguf_io writes and reads back) to __init__, sets its own sizes and `eps`, calls
make_weights(seed), and defines layer_weights(mk, il) (its weight list), build_layer (its mixer)
and n_embd_r / n_embd_s (its memory sizes)."""
from __future__ import annotations

import contextlib
import contextvars

import numpy as np

import minigraph as mg

# set by loading_weights() while a GGUF loader builds a model: {GGUF name: type in the file}
_LOADING: contextvars.ContextVar = contextvars.ContextVar("minigraph_loading_weights", default=None)


@contextlib.contextmanager
def loading_weights(types: dict):
    """While a model is constructed inside this block its WeightMakers make each weight with the
    type given here by GGUF name (f32 when absent) and draw and write no values: the loader
    fills (or maps) them from the file."""
    token = _LOADING.set(dict(types))
    try:
        yield
    finally:
        _LOADING.reset(token)


def layer_device_list(devices, n_layer: int, arch: str) -> list:
    """None -> cpu for every layer; one backend -> that backend everywhere; a list -> one per layer."""
    if devices is None:
        return [mg.backend("cpu")] * n_layer
    if isinstance(devices, mg.Backend):
        return [devices] * n_layer
    devices = list(devices)
    if len(devices) != n_layer:
        raise ValueError(f"{arch}: {len(devices)} devices for {n_layer} layers (need one backend per layer)")
    return devices


class WeightMaker:
    """Makes one device's f32 weights: tensors are created in one context and their seeded values
    kept aside; place(dev) allocates the context on the device and writes the values there."""

    def __init__(self, rng: np.random.Generator, named: dict, pending: list, mark_weights: bool = True):
        self.rng = rng
        self.pending = pending           # (ctx, device) whose memory a loader gives (while loading)
        self.named = named               # gguf name -> tensor, filled as weights are made
        self.mark_weights = mark_weights
        self.ctx = mg.Context()
        self.values = []                 # (tensor, values in NumPy order) until place()
        self.loading = _LOADING.get()    # {name: type} while a loader builds the model, else None

    def normal(self, ne, scale: float, mean: float = 0.0) -> np.ndarray:
        """mean + scale * N(0, 1) in NumPy order, float64 (a model may adjust it, then fixed());
        zeros while loading (the file's values replace them, drawing them would only cost time)."""
        if self.loading is not None:
            return np.zeros(tuple(reversed(ne)))
        return mean + scale * self.rng.standard_normal(tuple(reversed(ne)))

    def __call__(self, name: str, ne, scale: float, mean: float = 0.0) -> mg.Tensor:
        """A weight of seeded random values mean + scale * N(0, 1)."""
        return self.fixed(name, ne, self.normal(ne, scale, mean))

    def fixed(self, name: str, ne, arr) -> mg.Tensor:
        """A weight with the given values (NumPy order, rounded to f32); while loading, a weight
        of the file's type and no values."""
        type = mg.f32 if self.loading is None else self.loading.get(name, mg.f32)
        t = self.ctx.new_tensor(type, tuple(ne)).set_name(name)
        if self.mark_weights:
            t.set_weight()
        if self.loading is None:
            self.values.append((t, np.asarray(arr, np.float32).reshape(tuple(reversed(t.ne)))))
        self.named[name] = t
        return t

    def place(self, dev) -> None:
        """Give the weights memory on dev and write their values. While a loader builds the model
        nothing is allocated: the loader maps the file's pages where it can and then allocates the
        rest (pending_places), so mapped weights never hold a second, throw-away buffer."""
        if self.loading is not None:
            self.pending.append((self.ctx, dev))
            return
        mg.alloc_ctx_tensors(self.ctx, dev)
        for t, arr in self.values:
            t.set(arr)
        self.values = []


def require_equal_seqs(g, arch: str, il: int) -> None:
    """The mixers reshape [n_tokens] into [n_seq_tokens, n_seqs]: the ubatch must have been split
    with equal sequence lengths (llama.cpp's split_equal)."""
    if g.n_tokens != g.n_seq_tokens * g.n_seqs:
        raise ValueError(f"{arch} layer {il}: the ubatch needs equal sequences, but n_tokens {g.n_tokens} "
                         f"!= n_seq_tokens {g.n_seq_tokens} * n_seqs {g.n_seqs} (split it with split_equal)")


def build_norm(x: mg.Tensor, w: mg.Tensor | None, eps: float) -> mg.Tensor:
    """RMS norm over dim 0 times the weight (llama.cpp's build_norm with LLM_NORM_RMS); w None:
    the plain RMS norm."""
    x = mg.rms_norm(x, eps)
    return x if w is None else mg.mul(x, w)


def build_output_head(g, h: mg.Tensor, out_norm: mg.Tensor, output: mg.Tensor, eps: float) -> mg.Tensor:
    """The final norm and output head over the rows the ubatch wants logits for: the other rows
    are dropped first (a get_rows of llama.cpp's inp_out_ids), so a prefill pays the head for its
    last token only. h: [n_embd, n_tokens]. Returns 'logits' [n_vocab, n_outputs]."""
    out_ids = g.build_inp_out_ids()
    if out_ids is not None:
        h = mg.get_rows(h, out_ids)                                         # [n_embd, n_outputs]
    h = build_norm(h, out_norm, eps)
    return mg.mul_mat(output, h).set_name("logits").set_output()            # [n_vocab, n_outputs]


def build_ffn_swiglu(cur: mg.Tensor, w: dict) -> mg.Tensor:
    """ffn_down @ (silu(ffn_gate @ cur) * (ffn_up @ cur)). cur: [n_embd, n_tokens]."""
    gate = mg.mul_mat(w["ffn_gate"], cur)                                   # [n_ff, n_tokens]
    up = mg.mul_mat(w["ffn_up"], cur)                                       # [n_ff, n_tokens]
    return mg.mul_mat(w["ffn_down"], mg.mul(mg.silu(gate), up))             # [n_embd, n_tokens]


class RecurrentModel:
    """Base of the recurrent models: see the module docstring. After __init__ a model has
    n_vocab, n_embd, n_layer, hparams, layers, layer_devices, host (the last layer's device:
    embedding, final norm and output head live there), and after make_weights tok_embd,
    out_norm, output and layer_w (each layer's weights by short name)."""

    arch = "?"
    supports_rollback = True
    causal = True
    # operand order of the residual adds: add(cur, residual) (mamba2, qwen35) or add(residual, cur)
    # (lfm2 as llama.cpp writes it, kda, toy); the same values, but ADD's split rules on a meta
    # device read src0 first, so each model keeps its graph as written
    residual_first = False
    # attention layers (hybrid models): build_attn_layer instead of build_layer, K/V in the KV cache
    attn_layers: tuple = ()
    # with layer_outputs, build() also returns these per layer: 'mixer.{il}' (the mixer's
    # output) and/or 'l_out.{il}' (the block's output), [n_embd, n_tokens] each (tests)
    layer_output_names = ("l_out",)
    # weights the graphs read by row (GET_ROWS), not only as MUL_MAT's src0: a GGUF loader leaves
    # them in the file's layout (Backend.pack_weight packs the others where a backend has a layout)
    weights_read_by_row = ("token_embd.weight",)

    def __init__(self, hparams: dict, devices=None, layer_outputs: bool = False):
        """hparams: the structural constructor arguments (n_vocab, n_embd, n_layer, ...);
        devices: None (everything on cpu), one backend, or a list with one backend per layer."""
        self.hparams = hparams
        self.n_vocab, self.n_embd, self.n_layer = hparams["n_vocab"], hparams["n_embd"], hparams["n_layer"]
        self.layer_devices = layer_device_list(devices, self.n_layer, self.arch)
        self.host = self.layer_devices[-1]
        self.layers = list(range(self.n_layer))
        self.layer_outputs = layer_outputs
        self._named: dict[str, mg.Tensor] = {}      # gguf name -> tensor

    # -- weights ---------------------------------------------------------------------------------
    def make_weights(self, seed: int, out_norm: str = "output_norm", suffix: str = ".weight",
                     mark_weights: bool = True) -> None:
        """Seeded weights, drawn in a fixed order: embedding, final norm and output head on the
        host, then each layer's layer_weights(mk, il) on that layer's device."""
        rng = np.random.default_rng(seed)
        E, V = self.n_embd, self.n_vocab
        self.pending_places = []         # (ctx, device) whose memory a GGUF loader gives
        mk = WeightMaker(rng, self._named, self.pending_places, mark_weights)
        self.tok_embd = mk("token_embd" + suffix, (E, V), 1.0)
        self.out_norm = mk(out_norm + suffix, (E,), 0.1, 1.0)
        self.output = mk("output" + suffix, (E, V), 1 / np.sqrt(E))
        mk.place(self.host)
        self.layer_w = []
        for il in self.layers:
            mk = WeightMaker(rng, self._named, self.pending_places, mark_weights)
            self.layer_w.append(self.layer_weights(mk, il))
            mk.place(self.layer_devices[il])

    def layer_weights(self, mk: WeightMaker, il: int) -> dict:
        """Layer il's weights by short name, made with mk (the model's own list)."""
        raise NotImplementedError

    def ffn_weights(self, mk: WeightMaker, il: int, n_ff: int, norm: str = "ffn_norm") -> dict:
        """The SwiGLU FFN's weights and its pre-norm (GGUF name blk.{il}.{norm}.weight)."""
        E = self.n_embd
        return {
            "ffn_norm": mk(f"blk.{il}.{norm}.weight", (E,), 0.1, 1.0),
            "ffn_gate": mk(f"blk.{il}.ffn_gate.weight", (E, n_ff), 1 / np.sqrt(E)),
            "ffn_up": mk(f"blk.{il}.ffn_up.weight", (E, n_ff), 1 / np.sqrt(E)),
            "ffn_down": mk(f"blk.{il}.ffn_down.weight", (n_ff, E), 1 / np.sqrt(n_ff)),
        }

    def gguf_tensors(self) -> dict:
        """{GGUF tensor name: tensor}; each tensor's ne (trailing 1s dropped) is llama.cpp's shape."""
        return dict(self._named)

    # -- graph -----------------------------------------------------------------------------------
    def build_layer(self, g, inp_rs, cur: mg.Tensor, il: int) -> mg.Tensor:
        """Layer il's mixer. cur: the normed input [n_embd, n_tokens]. Returns [n_embd, n_tokens]."""
        raise NotImplementedError

    def build_attn_layer(self, g, inp_attn, cur: mg.Tensor, il: int) -> mg.Tensor:
        """Attention layer il (hybrid models). cur: [n_embd, n_tokens]. Returns [n_embd, n_tokens]."""
        raise NotImplementedError

    def residual(self, res: mg.Tensor, cur: mg.Tensor) -> mg.Tensor:
        return mg.add(res, cur) if self.residual_first else mg.add(cur, res)

    def _keep_layer_output(self, outs: dict, kind: str, il: int, t: mg.Tensor) -> None:
        if self.layer_outputs and kind in self.layer_output_names:
            outs[f"{kind}.{il}"] = t.set_name(f"{kind}.{il}").set_output()

    def build(self, g) -> dict:
        """g: models.graph.GraphContext. Returns {'logits': [n_vocab, n_outputs]} (and, with
        layer_outputs, the layer_output_names per layer)."""
        outs = {}
        tokens = g.build_inp_tokens()
        # a model whose every layer is attention has no recurrent state to read
        inp_rs = g.build_inp_rs() if len(self.attn_layers) < len(self.layers) else None
        inp_attn = g.build_attn_inp_kv(self.causal) if self.attn_layers else None
        h = mg.get_rows(self.tok_embd, tokens)                              # [n_embd, n_tokens]
        for il in self.layers:
            w = self.layer_w[il]
            cur = build_norm(h, w.get("attn_norm"), self.eps)               # [n_embd, n_tokens]
            if il in self.attn_layers:
                cur = self.build_attn_layer(g, inp_attn, cur, il)           # [n_embd, n_tokens]
            else:
                cur = self.build_layer(g, inp_rs, cur, il)                  # [n_embd, n_tokens]
            self._keep_layer_output(outs, "mixer", il, cur)
            h = self.residual(h, cur)
            if "ffn_norm" in w:                                             # a layer with an FFN
                cur = build_ffn_swiglu(build_norm(h, w["ffn_norm"], self.eps), w)
                h = self.residual(h, cur)
            self._keep_layer_output(outs, "l_out", il, h)
        logits = build_output_head(g, h, self.out_norm, self.output, self.eps)   # [n_vocab, n_outputs]
        g.gf.build_forward_expand(logits)
        for t in outs.values():          # computed even if nothing downstream reads them
            g.gf.build_forward_expand(t)
        outs["logits"] = logits
        return outs
