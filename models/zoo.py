"""Model names the command line and examples accept, and how to make a tiny seeded one."""
from __future__ import annotations

import importlib

import minigraph as mg

# name -> (module, class); classes take devices= (a backend or a list per layer) and seed=
MODELS = {
    "mamba2": ("minigraph.models.mamba2", "Mamba2Model"),
    "delta-net": ("minigraph.models.delta_net", "DeltaNetModel"),
    "lfm": ("minigraph.models.lfm", "LFM2Model"),
    "kda": ("minigraph.models.kda", "KDAModel"),
    "toy": ("minigraph.models.toy", "ToyConvModel"),
    "toy-tp": ("minigraph.models.toy_tp", "ToyConvTPModel"),   # the toy with out_proj: splits on a meta device
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
        if ch == "," and depth == 0:
            names.append(cur.strip()) if cur.strip() else None
            cur = ""
        else:
            cur += ch
    if not names:
        raise UsageError("--devices is empty")
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


def make_model(name: str, devices: list, seed: int = 0, gguf: str | None = None, **kw):
    if gguf:
        from .gguf_io import load_gguf
        probe = load_gguf(gguf, devices=devices[-1])
        n_layer = len(probe.layers)
        return load_gguf(gguf, devices=layer_devices(devices, n_layer))
    cls = model_class(name)
    n_layer = kw.pop("n_layer", getattr(cls, "DEFAULT_N_LAYER", 2))
    return cls(devices=layer_devices(devices, n_layer), n_layer=n_layer, seed=seed, **kw)
