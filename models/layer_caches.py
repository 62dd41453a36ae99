"""What the recurrent memory and the KV cache both need to hold per-layer caches: a per-layer size
(a number, or a function of the layer), each layer's device, and one context per device whose
tensors are given zeroed memory (ggml_backend_buffer_clear)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Sequence

import numpy as np

import minigraph as mg


def per_layer(v, il: int) -> int:
    """v(il) when v is a function of the layer, else v."""
    return int(v(il) if callable(v) else v)


def check_layers(layers: Sequence[int], what: str) -> list[int]:
    out = [int(il) for il in layers]
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: layer list has duplicates: {out}")
    return out


def layer_devices(layers: Sequence[int], devices, what: str) -> dict:
    """il -> backend, from one backend for every layer or a dict il -> backend."""
    if isinstance(devices, Mapping):
        missing = [il for il in layers if il not in devices]
        if missing:
            raise ValueError(f"{what}: no device given for layers {missing}")
        return {il: devices[il] for il in layers}
    if devices is None:
        raise ValueError(f"{what}: devices must be a backend or a dict il -> backend")
    return {il: devices for il in layers}


def alloc_zeroed(layers: Sequence[int], devices: dict, name: str,
                 make: Callable[[mg.Context, int], None]) -> list:
    """Call make(ctx, il) for every layer with the context of the layer's device (one per device,
    named `{name}_{device}`), then give each context's tensors one zeroed buffer on its device.
    Returns the buffers."""
    ctxs: dict[str, tuple] = {}
    for il in layers:
        dev = devices[il]
        if dev.name not in ctxs:
            ctxs[dev.name] = (mg.Context(f"{name}_{dev.name}"), dev)
        make(ctxs[dev.name][0], il)
    buffers = []
    for ctx, dev in ctxs.values():
        buf = mg.alloc_ctx_tensors(ctx, dev, usage="any")
        if buf is not None:
            dev.set_bytes(buf, 0, np.zeros(buf.nbytes, np.uint8))
            buffers.append(buf)
    return buffers
