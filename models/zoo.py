"""Model names the command line and examples accept, and how to make a tiny seeded one."""
from __future__ import annotations

import importlib

import minigraph as mg

# name -> (module, class); classes take devices= (a backend or a list per layer) and seed=
MODELS = {
    "mamba2": ("minigraph.models.mamba2", "Mamba2Model"),
    "delta-net": ("minigraph.models.delta_net", "DeltaNetModel"),
    "delta-net-hybrid": ("minigraph.models.delta_net", "DeltaNetHybridModel"),   # qwen35 with gated attention blocks
    "lfm": ("minigraph.models.lfm", "LFM2Model"),   # short conv + attention blocks (KV cache), as llama.cpp's files
    "lfm-hybrid": ("minigraph.models.lfm", "LFM2Model"),   # alias of lfm (its former hybrid name)
    "kda": ("minigraph.models.kda", "KDAModel"),
    "kda-hybrid": ("minigraph.models.kda", "KDAHybridModel"),   # kimi-linear with an MLA block (KV cache)
    "toy": ("minigraph.models.toy", "ToyConvModel"),
    "toy-tp": ("minigraph.models.toy_tp", "ToyConvTPModel"),   # the toy with out_proj: splits on a meta device
    "toy-hybrid": ("minigraph.models.toy_hybrid", "ToyHybridModel"),   # conv layers + attention (KV cache)
}


class UsageError(ValueError):
    """Bad command-line input: printed as one line, exit code 2."""


def model_class(name: str):
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
    mod, cls = MODELS[name]
    return getattr(importlib.import_module(mod), cls)


def parse_devices(spec: str) -> list:
    """'cpu' or 'cpu:1,cpu:0' or 'meta(cpu:0,cpu:1)' -> backends in priority order (the last one
    is the host)."""
    names, depth, cur = [], 0, ""          # commas inside meta(...) do not separate devices
    for ch in spec + ",":
        depth += (ch == "(") - (ch == ")")
        if depth < 0:
            raise UsageError(f"--devices {spec!r}: a ')' without its '(' (write e.g. meta(cpu:0,cpu:1))")
        if ch == "," and depth == 0:
            names.append(cur.strip()) if cur.strip() else None
            cur = ""
        else:
            cur += ch
    if depth > 0:
        raise UsageError(f"--devices {spec!r}: a '(' is never closed (write e.g. meta(cpu:0,cpu:1))")
    if not names:
        raise UsageError(f"--devices {spec!r}: no device named (write e.g. cpu, or cpu:1,cpu:0)")
    out = []
    for n in names:
        try:
            be = mg.backend(n)
        except Exception as e:       # unknown kind, bad syntax, missing extension or GPU
            raise UsageError(f"bad device {n!r}: {e}") from None
        if be in out:
            raise UsageError(f"device {n!r} is listed twice")
        out.append(be)
    return out


def layer_devices(devices: list, n_layer: int) -> list:
    """Split the layers into contiguous blocks, one per device, in the order given."""
    per = -(-n_layer // len(devices))
    return [devices[min(il // per, len(devices) - 1)] for il in range(n_layer)]


def file_arch(name: str) -> str:
    """The GGUF architecture a zoo model is saved as (its class's gguf_arch or arch)."""
    cls = model_class(name)
    return getattr(cls, "gguf_arch", None) or cls.arch


def zoo_name(arch: str) -> str | None:
    """The zoo name of a GGUF architecture (lfm2 -> lfm), None when the zoo has none."""
    for name in MODELS:
        try:
            if file_arch(name) == arch:
                return name
        except ImportError:
            continue
    return None


def gguf_model_info(path: str) -> tuple[str, type, dict]:
    """(architecture, model class, constructor hparams) of a GGUF file, from its metadata only:
    no tensor is read, so the model is built once, by load_gguf."""
    from .gguf_io import GGUFError, _hparams_from_file, model_class as gguf_class, read_metadata
    try:
        kv = read_metadata(path)
        arch = kv.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{path}: no general.architecture key")
        cls = gguf_class(arch)
        return arch, cls, _hparams_from_file(cls, arch, kv)
    except (GGUFError, ValueError, OSError) as e:
        why = str(e)
        why = why[len(str(path)) + 2:] if why.startswith(f"{path}: ") else why
        raise UsageError(f"--gguf {path}: {why}") from None


def recurrent_only(name: str, n_layer: int) -> dict:
    """make_model keywords that give the zoo model `name` of n_layer blocks recurrent blocks only
    (no attention block, so no KV cache, which an endless decode would fill): lfm, delta-net and
    kda have an attention block by default, as llama.cpp's files do."""
    if name in ("lfm", "lfm-hybrid"):
        return dict(head_count_kv=[0] * n_layer)
    if name == "delta-net":
        return dict(full_attention_interval=0)
    if name == "kda":
        return dict(head_count_kv=0)
    return {}


def make_model(name: str | None, devices: list, seed: int = 0, gguf: str | None = None, **kw):
    """A tiny seeded zoo model, or (gguf=path) the model a GGUF file holds, built once and split
    over devices. With a file, name may be None or must name the file's architecture."""
    if gguf:
        arch, _, hp = gguf_model_info(gguf)
        if name is not None and file_arch(name) != arch:
            raise UsageError(f"model {name!r} does not match --gguf {gguf}, which holds a "
                             f"{zoo_name(arch) or arch} model (arch {arch!r}); omit the model name "
                             "or give the file's")
        from .gguf_io import load_gguf
        return load_gguf(gguf, devices=layer_devices(devices, int(hp["n_layer"])))
    cls = model_class(name)
    n_layer = kw.pop("n_layer", getattr(cls, "DEFAULT_N_LAYER", 2))
    return cls(devices=layer_devices(devices, n_layer), n_layer=n_layer, seed=seed, **kw)
