"""GGUF files for the recurrent models, with llama.cpp's architecture names, metadata keys and
tensor names, through the `gguf` package (pip install 'minigraph[gguf]').

    save_gguf(model, path, ftype=None)         write a model's hyperparameters and weights (ftype:
                                               f16, bf16, q8_0, q4_0 or q4_k_m converts the f32
                                               weights by llama.cpp's rule, models/gguf_types.py)
    load_gguf(path, devices=None) -> model     build the arch's model class and fill its weights
                                               (any of those types; mapped from the file on ref/cpu)

Architectures: "lfm2" (models.lfm.LFM2Model), "kimi-linear" (models.kda.KDAModel), "mamba2"
(models.mamba2), "qwen35" (models.delta_net). A model class takes part through this protocol:

    arch             llama.cpp's architecture name (or `gguf_arch` when `arch` says something else)
    hparams          {constructor keyword: value}: `cls(**hparams, devices=...)` rebuilds the same
                     structure (with random weights that load_gguf then overwrites)
    gguf_tensors()   {GGUF tensor name: mg.Tensor}; the tensor's ne with trailing 1s dropped
                     (ggml_n_dims) is the shape written, e.g. ssm_conv1d_q [d_conv, 1, d_inner]
  optional:
    gguf_metadata()          {key without the "{arch}." prefix: value} replacing the table below
    hparams_from_gguf(kv)    classmethod, {key without prefix: value} -> hparams

Shapes: ggml's ne is the reverse of NumPy's shape; gguf-py writes a NumPy array's shape reversed
and reads it back as `ReaderTensor.shape` (ne order) with `.data` in NumPy order, so a tensor's
`numpy()` (shape = reversed ne[:n_dims]) is written as is and set back as is. Every file also
carries `minigraph.hparams` (the hparams dict as JSON): the loader prefers the standard keys for
the archs whose table it knows fully (lfm2, kimi-linear) and falls back to the JSON for the others,
so a file written here always loads back into the same structure.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
from struct import error as struct_error
from pathlib import Path

import numpy as np

import minigraph as mg
from minigraph.backend import Buffer, HostBackend
from minigraph.models import gguf_types
from minigraph.models.base import loading_weights
from minigraph.types import from_ggml_id

ARCH_CLASSES = {
    "lfm2": ("minigraph.models.lfm", "LFM2Model"),
    "kimi-linear": ("minigraph.models.kda", "KDAModel"),
    "mamba2": ("minigraph.models.mamba2", "Mamba2Model"),
    "qwen35": ("minigraph.models.delta_net", "DeltaNetModel"),
}
HPARAMS_KEY = "minigraph.hparams"


class GGUFError(ValueError):
    """A file or model this module cannot write or read."""


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("models.gguf_io needs the `gguf` package: pip install 'minigraph[gguf]' "
                          "(or pip install gguf)") from e
    return gguf


def _check_tensor_infos(path, reader, start_offs: int, fields) -> None:
    """Each tensor's type, row length, offset and extent, before gguf-py slices the data: one
    GGUFError naming the tensor for an unknown type, rows that are not whole blocks, an offset
    off the file's alignment (so off its blocks), data that overlaps the next tensor (its size
    does not match its type and shape) or runs past the end of the file (truncated)."""
    gguf = _gguf()
    infos = []
    for field in fields:
        _, name_data, _, dims, raw_dtype, offset = field.parts
        name = str(bytes(name_data), encoding="utf-8", errors="replace")
        try:
            qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
        except ValueError:
            raise GGUFError(f"{path}: tensor {name}: unknown ggml type id {int(raw_dtype[0])}") from None
        blck, size = gguf.GGML_QUANT_SIZES[qtype]
        ne = [int(x) for x in dims]
        if ne and ne[0] % blck:
            raise GGUFError(f"{path}: tensor {name}: {qtype.name} rows of ne0={ne[0]} are not whole blocks of {blck}")
        nbytes = int(np.prod(ne)) * size // blck
        offs = int(offset[0])
        if offs % reader.alignment:
            raise GGUFError(f"{path}: tensor {name}: data offset {offs} is not a multiple of the file's alignment "
                            f"{reader.alignment} (its {qtype.name} blocks would be misaligned)")
        infos.append((offs, nbytes, name, qtype.name, ne))
    infos.sort()
    for (offs, nbytes, name, tname, ne), nxt in zip(infos, infos[1:] + [None]):
        end = start_offs + offs + nbytes
        if end > len(reader.data):
            raise GGUFError(f"{path}: tensor {name}: its {nbytes} bytes ({tname}, ne={ne}) run past the end of the "
                            f"file ({len(reader.data)} bytes): the data section is truncated")
        if nxt is not None and offs + nbytes > nxt[0]:
            raise GGUFError(f"{path}: tensor {name}: {tname} ne={ne} takes {nbytes} bytes, but tensor {nxt[2]} starts "
                            f"{nxt[0] - offs} bytes after it: its size does not match its type and shape")


def _reader_class():
    gguf = _gguf()

    class CheckedReader(gguf.GGUFReader):
        """gguf-py's reader, copy-on-write mapped, with the tensor checks above first."""

        def _build_tensors(self, start_offs, fields):
            _check_tensor_infos(self._path, self, start_offs, fields)
            return super()._build_tensors(start_offs, fields)

        def __init__(self, path):
            self._path = path
            super().__init__(path, "c")     # private pages: weights mapped from it stay writable
    return CheckedReader


def _open(path):
    """The file's reader; a file that is not GGUF (bad magic, truncated) is a GGUFError naming it,
    a bad tensor one naming the tensor."""
    try:
        return _reader_class()(str(path))
    except (ValueError, IndexError, struct_error) as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None


# -- metadata: hparams <-> llama.cpp keys, per arch ----------------------------------------------
# Each entry: key (without "{arch}.") -> value. Ints are written as uint32, floats as float32,
# lists of ints as int32 arrays, strings as strings.

def _pick(hp: dict, *names, default=None):
    for n in names:
        if n in hp and hp[n] is not None:
            return hp[n]
    if default is not None:
        return default
    raise GGUFError(f"hparams {sorted(hp)} have none of {names}")


def _common(hp: dict) -> dict:
    return {
        "vocab_size": int(_pick(hp, "n_vocab")),
        "context_length": int(_pick(hp, "n_ctx_train", "n_ctx", default=4096)),
        "embedding_length": int(_pick(hp, "n_embd", "d_model")),
        "block_count": int(_pick(hp, "n_layer")),
        "attention.layer_norm_rms_epsilon": float(_pick(hp, "eps", "rms_eps", "norm_eps", "f_norm_rms_eps", default=1e-5)),
    }


def _common_back(kv: dict) -> dict:
    return {"n_vocab": kv["vocab_size"], "n_ctx_train": kv["context_length"], "n_embd": kv["embedding_length"],
            "n_layer": kv["block_count"], "eps": kv["attention.layer_norm_rms_epsilon"]}


def _meta_lfm2(hp):
    n_layer = int(hp["n_layer"])
    hkv = hp.get("head_count_kv") or [0] * n_layer
    return {**_common(hp),
            "shortconv.l_cache": int(hp["l_cache"]),
            "feed_forward_length": int(hp["n_ff"]),
            "attention.head_count": int(_pick(hp, "n_head", default=1)),
            "attention.head_count_kv": [int(x) for x in hkv],       # per layer; 0 = short-conv block
            "rope.freq_base": float(hp.get("rope_freq_base", 1e6))}


def _back_lfm2(kv):
    """lfm2 keys -> LFM2Model hparams, checked before any weight is read: head_count_kv is
    llama.cpp's per-layer array (a single number means the same for every layer)."""
    hp = {**_common_back(kv), "l_cache": kv["shortconv.l_cache"], "n_ff": kv["feed_forward_length"],
          "n_head": kv["attention.head_count"]}
    n_layer, n_embd, n_head = int(hp["n_layer"]), int(hp["n_embd"]), int(hp["n_head"])
    hkv = kv.get("attention.head_count_kv", 0)
    hkv = [int(hkv)] * n_layer if isinstance(hkv, (int, float)) else [int(x) for x in hkv]
    if len(hkv) != n_layer:
        raise GGUFError(f"lfm2: lfm2.attention.head_count_kv has {len(hkv)} entries, expected one per block "
                        f"(block_count {n_layer})")
    from .lfm import check_head_counts
    try:
        check_head_counts(n_embd, n_head, hkv, key="lfm2.")
    except ValueError as e:      # the model's own rules, checked before any weight is read
        raise GGUFError(str(e)) from None
    if any(hkv):
        for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
            if key in kv and int(kv[key]) != n_embd // n_head:
                raise GGUFError(f"lfm2: lfm2.{key} = {kv[key]}, expected embedding_length / head_count = "
                                f"{n_embd // n_head} (models.lfm has head_dim = n_embd / n_head)")
    if int(hp["l_cache"]) < 2:
        raise GGUFError(f"lfm2: lfm2.shortconv.l_cache = {hp['l_cache']}, expected > 1")
    hp["head_count_kv"] = hkv
    hp["rope_freq_base"] = float(kv.get("rope.freq_base", 10000.0))     # llama.cpp's default when absent
    return hp


def _meta_kimi(hp):
    n_layer, hd = int(hp["n_layer"]), int(hp["head_dim"])
    hkv = [int(x) for x in (hp.get("head_count_kv") or [0] * n_layer)]
    lora, r = int(hp.get("kv_lora_rank", hd)), int(hp.get("n_rot", 0))
    return {**_common(hp),
            "attention.head_count": int(hp["n_head"]),
            "attention.head_count_kv": hkv,                      # per block: 0 = KDA, 1 = MLA
            "kda.head_dim": hd,
            "ssm.conv_kernel": int(hp["d_conv"]),
            "feed_forward_length": int(hp["n_ff"]),
            # MoE keys llama.cpp reads even when every FFN is dense
            "expert_feed_forward_length": int(hp["n_ff"]),
            "expert_shared_count": 0,
            "expert_gating_func": 2,                            # sigmoid (unused: no MoE block)
            "leading_dense_block_count": n_layer,
            # MLA: the cached key is [kv | k_pe] (key_length), the values its kv part (value_length)
            "attention.key_length_mla": int(hp.get("mla_k_head_dim", hd)),
            "attention.value_length_mla": int(hp.get("mla_v_head_dim", hd)),
            "attention.kv_lora_rank": lora,
            **({"attention.key_length": lora + r, "attention.value_length": lora, "rope.dimension_count": r}
               if any(hkv) else {})}


def _back_kimi(kv):
    """kimi-linear keys -> KDAModel hparams, checked before any weight is read."""
    n_layer = int(kv["block_count"])
    hkv = kv.get("attention.head_count_kv", 0)
    hkv = [int(hkv)] * n_layer if isinstance(hkv, (int, float)) else [int(x) for x in hkv]
    if len(hkv) != n_layer:
        raise GGUFError(f"kimi-linear: kimi-linear.attention.head_count_kv has {len(hkv)} entries, expected one "
                        f"per block (block_count {n_layer})")
    dense = int(kv.get("leading_dense_block_count", 0))
    if dense < n_layer:
        raise GGUFError(f"kimi-linear: block {dense} has a MoE FFN (kimi-linear.leading_dense_block_count = {dense} "
                        f"< block_count {n_layer}; blk.{dense}.ffn_gate_exps.weight): minigraph runs dense FFNs only")
    hp = {**_common_back(kv), "n_head": kv["attention.head_count"], "head_dim": kv["kda.head_dim"],
          "d_conv": kv["ssm.conv_kernel"], "n_ff": kv["feed_forward_length"], "head_count_kv": hkv}
    if any(hkv):
        if "attention.q_lora_rank" in kv:
            raise GGUFError("kimi-linear: kimi-linear.attention.q_lora_rank is set (a compressed query: "
                            "attn_q_a / attn_q_b): minigraph's MLA reads attn_q only, as Kimi-Linear has")
        r = int(kv.get("rope.dimension_count", 0))
        lora = int(kv["attention.kv_lora_rank"])
        for key, want in (("attention.key_length", lora + r), ("attention.value_length", lora)):
            if key in kv and int(kv[key]) != want:
                raise GGUFError(f"kimi-linear: kimi-linear.{key} = {kv[key]}, expected {want} (the MLA cache's "
                                "key is [kv_lora_rank | rope.dimension_count], its values the kv part)")
        hp.update(kv_lora_rank=lora, n_rot=r,
                  mla_k_head_dim=int(kv["attention.key_length_mla"]),
                  mla_v_head_dim=int(kv["attention.value_length_mla"]))
        from .kda import check_mla
        try:
            check_mla(int(hp["n_head"]), hkv, hp["mla_k_head_dim"], r, hp["mla_v_head_dim"], lora,
                      key="kimi-linear.")
        except ValueError as e:
            raise GGUFError(str(e)) from None
    return hp


def _meta_mamba2(hp):
    return {**_common(hp),
            "ssm.conv_kernel": int(_pick(hp, "d_conv", "ssm_d_conv")),
            "ssm.inner_size": int(_pick(hp, "d_inner", "ssm_d_inner")),
            "ssm.state_size": int(_pick(hp, "d_state", "ssm_d_state")),
            "ssm.time_step_rank": int(_pick(hp, "n_head", "dt_rank", "ssm_dt_rank")),
            "ssm.group_count": int(_pick(hp, "n_group", "ssm_n_group", default=1))}


def _back_mamba2(kv):
    return {**_common_back(kv), "d_conv": kv["ssm.conv_kernel"], "d_inner": kv["ssm.inner_size"],
            "d_state": kv["ssm.state_size"], "n_head": kv["ssm.time_step_rank"], "n_group": kv["ssm.group_count"]}


def _meta_qwen35(hp):
    n_layer = int(hp["n_layer"])
    head_dim = int(_pick(hp, "head_dim", "head_k_dim", "d_state", "ssm_d_state"))
    n_k = int(_pick(hp, "n_k_heads", "num_k_heads", "n_k_head", "n_group", "ssm_n_group"))
    n_v = int(_pick(hp, "n_v_heads", "num_v_heads", "n_v_head", "n_head", "ssm_dt_rank"))
    out = {**_common(hp),
           "ssm.conv_kernel": int(_pick(hp, "d_conv", "ssm_d_conv")),
           "ssm.state_size": head_dim,
           "ssm.group_count": n_k,
           "ssm.time_step_rank": n_v,
           "ssm.inner_size": int(_pick(hp, "d_inner", default=head_dim * n_v)),
           "feed_forward_length": int(_pick(hp, "n_ff"))}
    interval = int(hp.get("full_attention_interval") or 0)
    if interval:                      # gated attention blocks at (il + 1) % interval == 0
        d = int(hp.get("attn_head_dim") or head_dim)
        n_rot = int(hp.get("n_rot") or d)
        sections = hp.get("rope_sections") or [n_rot // 2 - 2 * (n_rot // 6), n_rot // 6, n_rot // 6, 0]
        return {**out,
                "full_attention_interval": interval,
                "attention.head_count": int(hp.get("n_head", 4)),
                "attention.head_count_kv": int(hp.get("n_head_kv", 2)),
                "attention.key_length": d,
                "attention.value_length": d,
                "rope.dimension_count": n_rot,
                "rope.dimension_sections": [int(x) for x in sections],
                "rope.freq_base": float(hp.get("rope_freq_base", 1e7))}
    # every block is a delta-net block: the attention interval lies past the last block;
    # llama.cpp's loader requires the attention keys even without attention blocks
    return {**out,
            "full_attention_interval": n_layer + 1,
            "attention.head_count": 1,
            "attention.head_count_kv": 1,
            "attention.key_length": head_dim,
            "attention.value_length": head_dim,
            "rope.dimension_count": head_dim,
            "rope.dimension_sections": [max(1, head_dim // 8)] * 3 + [0]}


def _qwen35_attn_layers(kv, n_layer: int) -> tuple[list, int]:
    """(attention blocks, interval) as llama.cpp's qwen35 loader finds them: the per-block
    attention.recurrent_layers array when present, else full_attention_interval (default 4):
    block il is attention when (il + 1) % interval == 0."""
    if "attention.recurrent_layers" in kv:
        recr = [bool(x) for x in kv["attention.recurrent_layers"]][:n_layer]
        if len(recr) != n_layer:
            raise GGUFError(f"qwen35: qwen35.attention.recurrent_layers has {len(recr)} entries, expected one "
                            f"per block (block_count {n_layer})")
        attn = [il for il in range(n_layer) if not recr[il]]
        interval = attn[0] + 1 if attn else 0
        if attn and attn != [il for il in range(n_layer) if (il + 1) % interval == 0]:
            raise GGUFError(f"qwen35: qwen35.attention.recurrent_layers puts attention at blocks {attn}, "
                            "expected every k-th block (models.delta_net has full_attention_interval layouts only)")
        return attn, interval
    interval = int(kv.get("full_attention_interval", 4))
    if interval <= 0:
        raise GGUFError(f"qwen35: qwen35.full_attention_interval = {interval}, expected > 0")
    return [il for il in range(n_layer) if (il + 1) % interval == 0], interval


def _back_qwen35(kv):
    """qwen35 keys -> DeltaNetModel hparams, checked before any weight is read."""
    hp = {**_common_back(kv), "d_conv": kv["ssm.conv_kernel"], "head_dim": kv["ssm.state_size"],
          "num_k_heads": kv["ssm.group_count"], "num_v_heads": kv["ssm.time_step_rank"],
          "n_ff": kv["feed_forward_length"]}
    n_layer, n_embd = int(hp["n_layer"]), int(hp["n_embd"])
    d_state, n_k, n_v = int(hp["head_dim"]), int(hp["num_k_heads"]), int(hp["num_v_heads"])
    if n_k <= 0 or n_v <= 0 or n_v % n_k:
        raise GGUFError(f"qwen35: qwen35.ssm.time_step_rank {n_v} must be a multiple of ssm.group_count {n_k}")
    if "ssm.inner_size" in kv and int(kv["ssm.inner_size"]) != d_state * n_v:
        raise GGUFError(f"qwen35: qwen35.ssm.inner_size = {kv['ssm.inner_size']}, expected ssm.state_size * "
                        f"ssm.time_step_rank = {d_state * n_v} (head_v_dim = head_k_dim)")
    attn, interval = _qwen35_attn_layers(kv, n_layer)
    if not attn:
        return {**hp, "full_attention_interval": 0}          # every block a delta-net
    n_head = int(kv["attention.head_count"])
    hkv = kv.get("attention.head_count_kv", n_head)
    if not isinstance(hkv, (int, float)):
        vals = {int(hkv[il]) for il in attn} if len(hkv) == n_layer else None
        if vals is None or len(vals) != 1:
            raise GGUFError(f"qwen35: qwen35.attention.head_count_kv {list(hkv)}, expected one value for "
                            "every attention block")
        hkv = vals.pop()
    n_head_kv = int(hkv)
    d = int(kv.get("attention.key_length", n_embd // max(n_head, 1)))
    if int(kv.get("attention.value_length", d)) != d:
        raise GGUFError(f"qwen35: qwen35.attention.value_length = {kv['attention.value_length']}, expected "
                        f"key_length {d}")
    n_rot = int(kv.get("rope.dimension_count", d))
    sections = [int(x) for x in kv.get("rope.dimension_sections", [])]
    from .delta_net import check_attention
    try:             # the model's own rules, checked before any weight is read
        check_attention(n_head, n_head_kv, d, n_rot, sections[:4] if len(sections) >= 4 else sections,
                        key="qwen35.")
    except ValueError as e:
        raise GGUFError(str(e)) from None
    if float(kv.get("attention.scale", 0.0)) != 0.0:
        raise GGUFError(f"qwen35: qwen35.attention.scale = {kv['attention.scale']}, expected 0 "
                        "(models.delta_net scales by 1/sqrt(key_length))")
    hp.update(full_attention_interval=interval, n_head=n_head, n_head_kv=n_head_kv, attn_head_dim=d,
              n_rot=n_rot, rope_sections=sections[:4], rope_freq_base=float(kv.get("rope.freq_base", 10000.0)))
    return hp


ARCH_META = {
    "lfm2": (_meta_lfm2, _back_lfm2, True),          # (hparams -> keys, keys -> hparams, table complete)
    "kimi-linear": (_meta_kimi, _back_kimi, True),
    "mamba2": (_meta_mamba2, _back_mamba2, False),
    "qwen35": (_meta_qwen35, _back_qwen35, False),
}


# -- model classes --------------------------------------------------------------------------------

def model_arch(model) -> str:
    return getattr(model, "gguf_arch", None) or model.arch


def model_class(arch: str):
    """The model class for a GGUF architecture name."""
    if arch not in ARCH_CLASSES:
        raise GGUFError(f"unsupported GGUF architecture {arch!r}: known are {sorted(ARCH_CLASSES)}")
    mod_name, cls_name = ARCH_CLASSES[arch]
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name != mod_name:
            raise
        raise GGUFError(f"architecture {arch!r} needs {mod_name}, which is not there") from None
    cls = getattr(mod, cls_name, None)
    if cls is None:                       # any class of the module that says it is this arch
        for obj in vars(mod).values():
            if inspect.isclass(obj) and obj.__module__ == mod.__name__ and \
                    (getattr(obj, "gguf_arch", None) or getattr(obj, "arch", None)) == arch:
                cls = obj
                break
    if cls is None:
        raise GGUFError(f"no model class for architecture {arch!r} in {mod_name}")
    return cls


def _tensors_of(model) -> dict:
    fn = getattr(model, "gguf_tensors", None)
    if fn is None:
        raise GGUFError(f"{type(model).__name__} has no gguf_tensors(): cannot map its weights to GGUF names")
    return dict(fn())


def _hparams_of(model) -> dict:
    hp = getattr(model, "hparams", None)
    if not isinstance(hp, dict):
        raise GGUFError(f"{type(model).__name__} has no `hparams` dict of constructor arguments")
    return dict(hp)


def _metadata(model, arch: str, hp: dict) -> dict:
    fn = getattr(model, "gguf_metadata", None)
    if fn is not None:
        return dict(fn())
    return ARCH_META[arch][0](hp)


# -- writing --------------------------------------------------------------------------------------

def _add_kv(writer, gguf, key: str, val):
    T = gguf.GGUFValueType
    if isinstance(val, bool):
        writer.add_bool(key, val)
    elif isinstance(val, (int, np.integer)):
        writer.add_uint32(key, int(val))
    elif isinstance(val, (float, np.floating)):
        writer.add_float32(key, float(val))
    elif isinstance(val, str):
        writer.add_string(key, val)
    elif isinstance(val, (list, tuple)):
        if all(isinstance(x, (int, np.integer)) for x in val):
            writer.add_key_value(key, [int(x) for x in val], T.ARRAY, sub_type=T.INT32)
        elif all(isinstance(x, (float, np.floating)) for x in val):
            writer.add_key_value(key, [float(x) for x in val], T.ARRAY, sub_type=T.FLOAT32)
        else:
            writer.add_key_value(key, [str(x) for x in val], T.ARRAY, sub_type=T.STRING)
    else:
        raise GGUFError(f"metadata {key}: cannot write a {type(val).__name__}")


def save_gguf(model, path, *, embed_hparams: bool = True, tie_output: bool = False, ftype=None) -> Path:
    """Write the model's hyperparameters (llama.cpp keys) and weights (llama.cpp names).

    embed_hparams: also write the hparams dict as JSON under `minigraph.hparams` (default);
    without it the file holds only what llama.cpp reads. tie_output: leave `output.weight` out
    (llama.cpp then uses the embedding; only valid when the two are equal). ftype: None writes
    each weight in its own type (f32, or what a loaded file held); "f32", "f16", "bf16", "q8_0",
    "q4_0" or "q4_k_m" converts the model's f32 weights by llama.cpp's rule (models.gguf_types)."""
    gguf = _gguf()
    arch = model_arch(model)
    if arch not in ARCH_META:
        raise GGUFError(f"unsupported GGUF architecture {arch!r}: known are {sorted(ARCH_META)}")
    hp = _hparams_of(model)
    tensors = _tensors_of(model)
    if tie_output:
        out, emb = tensors.pop("output.weight", None), tensors.get("token_embd.weight")
        if out is None or emb is None or not np.array_equal(out.numpy(), emb.numpy()):
            raise GGUFError("tie_output: output.weight must exist and equal token_embd.weight")
    try:
        key = None if ftype is None else gguf_types.file_type(ftype)
    except ValueError as e:
        raise GGUFError(f"ftype: {e}") from None
    if key is not None:
        converting = [f"{n} ({t.type.name})" for n, t in tensors.items() if t.type != mg.f32]
        if converting:
            raise GGUFError(f"ftype={key}: converts f32 weights only; {converting[0]} is not f32 "
                            f"(write it with ftype=None to keep its type)")
        types = gguf_types.weight_types({n: t.ne for n, t in tensors.items()}, key, model.n_layer)
        file_type = gguf_types.FILE_TYPES[key][1]
    else:
        types = {n: t.type for n, t in tensors.items()}
        file_type = _file_type_of(types)
    path = Path(path)
    # written beside the target, then renamed over it: a model whose weights are mapped from the
    # target file keeps reading the old file (its inode lives on), and a failed write leaves it as it was
    tmp = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    done = False
    try:
        writer.add_name(f"minigraph tiny {arch}")
        writer.add_file_type(file_type)
        for key_, val in _metadata(model, arch, hp).items():
            _add_kv(writer, gguf, f"{arch}.{key_}", val)
        writer.add_tokenizer_model("none")                       # token ids are fed directly
        if embed_hparams:
            writer.add_string(HPARAMS_KEY, json.dumps(hp, sort_keys=True))
        for k, (val, vtype, sub) in getattr(model, "gguf_extra_kv", {}).items():   # kept from a loaded file
            writer.add_key_value(k, val, vtype, sub_type=sub)
        for name, t in tensors.items():
            data = t.numpy() if t.type == types[name] else gguf_types.convert_values(t.numpy(), types[name])
            data = np.ascontiguousarray(data)
            if types[name] in (mg.f32, mg.f16):
                writer.add_tensor(name, data)
            else:                                                # bf16 bits and raw blocks as bytes
                raw = data.view(np.uint8).reshape(data.shape[:-1] + (-1,))
                writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(types[name].ggml_id))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        done = True
    finally:
        writer.close()
        if done:
            os.replace(tmp, path)
        else:
            tmp.unlink(missing_ok=True)
    return path


def _file_type_of(types: dict) -> int:
    """llama.cpp's general.file_type for weights already typed: the most common 2-D type."""
    counts: dict = {}
    for t in types.values():
        if t != mg.f32:
            counts[t] = counts.get(t, 0) + 1
    if not counts:
        return 0
    main = max(counts, key=counts.get)
    by_type = {v[0]: v[1] for v in gguf_types.FILE_TYPES.values()}
    return by_type.get(main, 0)


# -- reading --------------------------------------------------------------------------------------

def _py(v):
    # float32 values come back as the shortest decimal that gives the same float32 (1e-05, not
    # 9.99999974e-06), so hparams compare equal to what was written
    if isinstance(v, np.floating) and v.dtype == np.float32:
        return float(str(v))
    if isinstance(v, np.generic):
        return v.item()
    return v


def _field_value(field):
    v = field.contents()
    if isinstance(v, list):
        if field.types and field.types[-1] == _gguf().GGUFValueType.FLOAT32:
            return [float(str(np.float32(x))) for x in v]
        return [_py(x) for x in v]
    if isinstance(v, float) and field.types and field.types[0] == _gguf().GGUFValueType.FLOAT32:
        return float(str(np.float32(v)))
    return _py(v)


def read_metadata(path) -> dict:
    """All key/value pairs of a GGUF file, values as Python objects."""
    reader = _open(path)
    return {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def _hparams_from_file(cls, arch: str, kv_all: dict) -> dict:
    prefix = arch + "."
    kv = {k[len(prefix):]: v for k, v in kv_all.items() if k.startswith(prefix)}
    own = getattr(cls, "hparams_from_gguf", None)
    if own is not None:
        return dict(own(kv))
    _, back, complete = ARCH_META[arch]
    if complete or HPARAMS_KEY not in kv_all:
        try:
            hp = back(kv)
        except KeyError as e:
            raise GGUFError(f"{arch}: metadata key {prefix}{e.args[0]} is missing") from None
    else:
        hp = json.loads(kv_all[HPARAMS_KEY])
    # keep the hparams the extra JSON adds beyond the standard keys (e.g. a class's own options)
    if HPARAMS_KEY in kv_all:
        for k, v in json.loads(kv_all[HPARAMS_KEY]).items():
            hp.setdefault(k, v)
    params = inspect.signature(cls).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        hp = {k: v for k, v in hp.items() if k in params}
    return hp


def load_gguf(path, devices=None, *, map_weights: bool | None = None, pack_weights: bool = True):
    """Read a GGUF file written by save_gguf (or any file of the same structure): construct the
    arch's model class on `devices` (None, one backend, or one per layer) and fill its weights.

    Weights keep the file's type (f32, f16, bf16, q8_0, q4_0, q4_k, q6_k). On host backends
    with map_weights, a weight's memory is the file's mapping itself (copy-on-write pages:
    nothing is read until used, and writing a weight never changes the file) when its data sits
    on a 32-byte boundary, which the GGUF alignment (32 by default) gives; a weight off it (a
    file with a smaller alignment), and every weight on other backends, is copied. map_weights
    None: each host backend's choice (HostBackend.maps_file_weights: ref maps, cpu reads the
    weights into memory of its own, straight from the file, without touching the mapping).

    pack_weights: a weight read into a backend's own memory and used by the graphs only as
    MUL_MAT's weights (all but the model's weights_read_by_row) is then rearranged in place for
    that backend's kernels where it has such a layout (Backend.pack_weight: the cpu backend's q4_K
    rows on AVX-512 VNNI builds). Results are unchanged; Tensor.numpy() still gives the file's
    bytes, and any other op that reads such a weight is refused (load with False to allow it)."""
    reader = _open(path)
    kv_all = {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    arch = kv_all.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: no general.architecture key")
    cls = model_class(arch)
    hp = _hparams_from_file(cls, arch, kv_all)
    found = {t.name: t for t in reader.tensors}
    types = {}
    for name, rt in found.items():
        try:
            types[name] = from_ggml_id(int(rt.tensor_type))
        except TypeError as e:
            raise GGUFError(f"{path}: tensor {name}: {e}") from None
    tied = "output.weight" not in found and "token_embd.weight" in found
    if tied:
        types["output.weight"] = types["token_embd.weight"]
    try:
        with loading_weights(types):
            model = cls(**hp, devices=devices)
    except mg.OpError as e:
        raise GGUFError(f"{path}: {e}") from None
    want = _tensors_of(model)
    missing = [n for n in want if n not in found]
    if "output.weight" in missing and tied:
        missing.remove("output.weight")                      # tied head (llama.cpp's fallback)
        found["output.weight"] = found["token_embd.weight"]
    if missing:
        raise GGUFError(f"{path}: tensors missing for {arch}: {missing}")
    extra = sorted(set(found) - set(want) - {"output.weight"})
    if extra:
        raise GGUFError(f"{path}: tensors {extra} have no place in {cls.__name__}")
    for name, t in want.items():              # every type and shape checked before any data is read
        rt = found[name]
        ne = tuple(int(x) for x in rt.shape)
        if ne + (1,) * (4 - len(ne)) != t.ne:
            raise GGUFError(f"{name}: shape in file ne={list(ne)}, model expects ne={list(t.ne[:t.n_dims()])}")
        if types[name] != t.type:
            raise GGUFError(f"{name}: type in file {types[name].name}, model made {t.type.name}")
    # the device each weight goes to: while loading, the model gave them no memory (pending_places:
    # the loader's to allocate, below, once it knows which weights the file's pages back)
    places, model.pending_places = model.pending_places, []
    device_of = {id(t): dev for ctx, dev in places for t in ctx.leaves()}

    def device(t):
        return t.backend if t.buffer is not None else device_of.get(id(t))

    for name, t in want.items():              # raw blocks only where the device's kernels take them
        dev = device(t)
        if not t.type.numpy_native and not isinstance(dev, HostBackend) and t.type.name not in dev.wide_types:
            raise GGUFError(f"{path}: tensor {name} is {t.type.name}: backend {dev.name} has no kernels for "
                            f"{t.type.name} (load it on ref or cpu)")
    mapped: dict = {}                         # backend -> one Buffer over the whole mapping
    copied = []
    for name, t in want.items():
        rt = found[name]
        dev = device(t)
        host = isinstance(dev, HostBackend)
        maps = host and (dev.maps_file_weights if map_weights is None else map_weights)
        if maps and (rt.data_offset % 32 == 0) and _mappable(t):
            buf = mapped.get(id(dev))
            if buf is None:
                buf = mapped[id(dev)] = Buffer(dev, len(reader.data), "weights", reader.data)
            t.buffer, t.offs = buf, int(rt.data_offset)
        else:
            copied.append((t, rt, host and _mappable(t)))
    # memory only for the weights not mapped (the model made none while loading), then their data
    for ctx, dev in places:
        mg.alloc_ctx_tensors(ctx, dev)
    with open(path, "rb") as f:
        for t, rt, raw in copied:
            if raw:      # the file's bytes are the stored bytes: read them in place (the mapping's
                _read_into(f, path, rt, t)   # pages are never touched, so they never count as ours)
            else:
                t.set(_as_stored(rt.data, t))
    if pack_weights:
        by_row = set(model.weights_read_by_row)
        read_in = {id(t) for t, _, raw in copied if raw}     # in the backend's own memory, not mapped
        for name, t in want.items():
            if name not in by_row and id(t) in read_in:
                t.backend.pack_weight(t)
    model.gguf_extra_kv = _extra_fields(reader, model, arch, hp)
    return model


def _read_into(f, path, rt, t):
    """Read a contiguous weight's bytes from the open file straight into its host memory."""
    buf, offs = t.storage()
    n = t.nbytes()
    f.seek(int(rt.data_offset))
    if f.readinto(memoryview(buf.mem)[offs:offs + n]) != n:
        raise GGUFError(f"{path}: tensor {rt.name}: the file ends inside its data")


def _mappable(t) -> bool:
    """A weight that owns its memory, laid out contiguously as the file holds it."""
    return t.view_src is None and t.is_contiguous()


def _as_stored(data, t) -> np.ndarray:
    """A tensor's file data as ``set`` takes it."""
    if t.type.is_quantized or t.type == mg.bf16:
        return np.ascontiguousarray(data).view(t.type.np_dtype).reshape(t.storage_shape)
    return np.ascontiguousarray(data, dtype=t.type.np_dtype).reshape(t.shape)


def _extra_fields(reader, model, arch: str, hp: dict) -> dict:
    """{key: (value, GGUF type, array sub type)} of the file's keys save_gguf would not write
    itself, so a load -> save round trip keeps them (with their types)."""
    ours = {f"{arch}.{k}" for k in _metadata(model, arch, hp)}
    ours |= {"general.architecture", "general.name", "general.file_type", "tokenizer.ggml.model", HPARAMS_KEY}
    T = _gguf().GGUFValueType
    out = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in ours:
            continue
        sub = f.types[-1] if f.types and f.types[0] == T.ARRAY and len(f.types) > 1 else None
        out[name] = (_field_value(f), f.types[0], sub)
    return out


__all__ = ["save_gguf", "load_gguf", "read_metadata", "model_class", "GGUFError", "ARCH_CLASSES", "HPARAMS_KEY"]
