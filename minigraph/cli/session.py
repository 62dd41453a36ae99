"""From the model flags to devices, a model and runners: every value is checked before anything
big is built (the model itself, its memory), and each bad one stops the command with one line."""
from __future__ import annotations

import argparse
import os
import sys

from minigraph.models.zoo import MODELS

from .args import byte_size, int_at_least
from .errors import fail

ZOO_NAMES = ", ".join(MODELS)   # the zoo is the one list of model names
MODEL_HELP = (f"a zoo model ({ZOO_NAMES}); optional with --gguf "
              "(the file says which model it is; a name given must be the file's)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--devices", default="cpu", help="comma-separated devices in priority order, the host last "
                   "(default: cpu), e.g. cpu:1,cpu:0 or meta(cpu:0,cpu:1); layers are split over them in order")
    p.add_argument("--n-rs-seq", type=int_at_least(0), default=3,
                   help="rollback depth: how many tokens can be rolled back (K = n_rs_seq + 1 state slots; default 3)")
    p.add_argument("--slot-order", default="per-layer", choices=["per-layer", "shared-first-layer", "host-input"],
                   help="where each conv layer's slot-order tensor is built (default: per-layer)")
    p.add_argument("--ubatch", type=int_at_least(1), default=None,
                   help="tokens per ubatch; must be >= n_rs_seq + 2 when rollback is on "
                        "(default: max(8, n_rs_seq + 2))")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="CPU threads per device, 1 to 512 (default: all cores; more than the cores is "
                        "allowed with a warning)")
    p.add_argument("--layers", type=int_at_least(1), default=None,
                   help="number of layers (default: the model's); not with --gguf")
    p.add_argument("--seed", type=int_at_least(0), default=None,
                   help="seed of the model's weights and of the token stream (default 0); not with --gguf")
    p.add_argument("--gguf", default=None, metavar="FILE",
                   help="take the model and its weights from a GGUF file (written by minigraph's save_gguf)")
    p.add_argument("--max-memory", type=byte_size, default=None, metavar="SIZE",
                   help="refuse a run whose estimated memory exceeds SIZE, e.g. 512M or 2G "
                        "(always refused above the machine's available memory)")
    p.add_argument("--json", action="store_true", help="print one JSON object (schema: minigraph/cli/schema.json)")


def _check_model_flags(args) -> None:
    if args.gguf:
        if not os.path.isfile(args.gguf):
            fail(f"--gguf {args.gguf}: no such file")
        if args.layers is not None:
            fail("--layers: not allowed with --gguf (the file sets the number of layers)")
        if args.seed is not None:
            fail("--seed: not allowed with --gguf (the file holds the weights; the token stream uses seed 0)")
    elif args.model is None:
        fail(f"MODEL is missing: name one of {ZOO_NAMES}, or give --gguf FILE")


def _probe_maker(args):
    """make(device, n_layer) -> a small model of the asked kind, for the memory estimate."""
    from minigraph.models.zoo import gguf_model_info, model_class
    if args.gguf:
        _, cls, hp = gguf_model_info(args.gguf)
        return lambda dev, n: cls(**{**hp, "n_layer": n}, devices=dev), int(hp["n_layer"]), cls
    cls = model_class(args.model)
    default = getattr(cls, "DEFAULT_N_LAYER", 2)
    return lambda dev, n: cls(devices=dev, n_layer=n, seed=0), args.layers or default, cls


def setup(args, runners: int, state_copies: int = 0, max_tokens: int | None = None):
    """Check the model flags, estimate the memory, then make the devices and the model.
    runners, state_copies: how many recurrent memories the command keeps (for the estimate);
    max_tokens: the most tokens one decode call of the command holds (a ubatch is never larger).
    Returns (devices, model, label); label names the model in outputs."""
    from minigraph.models.zoo import UsageError, file_arch, make_model, parse_devices, zoo_name
    from . import memory
    _check_model_flags(args)
    try:
        devices = parse_devices(args.devices)
        if args.gguf and args.model is not None:
            file_arch(args.model)                  # an unknown name fails before the file is read
        make_probe, n_layer, cls = _probe_maker(args)
        if n_layer < len(devices):
            fail(f"--layers {n_layer}: fewer layers than the {len(devices)} devices of --devices "
                 f"{args.devices} (each device needs at least one layer)")
        n_rs_seq = args.n_rs_seq if getattr(cls, "supports_rollback", False) and getattr(cls, "causal", True) else 0
        _check_ubatch(args, n_rs_seq)
        tokens = args.ubatch if max_tokens is None else min(args.ubatch, max_tokens)
        est = memory.estimate(make_probe, n_layer, n_rs_seq, tokens, runners, state_copies)
        memory.check(est, args.max_memory, "--n-rs-seq, --layers or --ubatch")
        _set_threads(devices, args.threads)
        kw = {"n_layer": args.layers} if args.layers else {}
        model = make_model(args.model, devices, seed=args.seed or 0, gguf=args.gguf, **kw)
    except UsageError as e:
        fail(str(e))
    for d in devices:                  # a meta device splits the model by heads where it can
        if hasattr(d, "set_split_state"):
            from minigraph.backends.meta import recipe_for
            d.set_split_state(recipe_for(model))
    label = args.model or zoo_name(getattr(model, "gguf_arch", None) or model.arch) or model.arch
    return devices, model, label


def _set_threads(devices, threads: int | None) -> None:
    """--threads on every device that has a thread count: a value the device refuses stops the
    command (exit 2), and its warning (more threads than cores) is one line naming the flag."""
    import warnings
    if threads is None:
        return
    for d in devices:
        if not hasattr(d, "set_n_threads"):
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                d.set_n_threads(threads)
            except ValueError as e:
                fail(f"argument --threads: {e}")
        for w in caught:
            print(f"minigraph: warning: --threads {threads}: {w.message}", file=sys.stderr)


def _check_ubatch(args, n_rs_seq: int) -> None:
    """A ubatch keeps a sequence's last n_rs_seq + 1 tokens together, so it must hold n_rs_seq + 2."""
    need = n_rs_seq + 2 if n_rs_seq > 0 else 1
    if args.ubatch is None:
        args.ubatch = max(8, need)
    elif args.ubatch < need:
        fail(f"--ubatch {args.ubatch}: must be >= --n-rs-seq + 2 = {need} (a ubatch keeps the last "
             f"n_rs_seq + 1 tokens of a sequence together); raise --ubatch or lower --n-rs-seq")


def make_runner(model, devices, args, **kw):
    from minigraph.models.runner import Runner
    from .memory import MEM_SIZE
    return Runner(model, mem_size=MEM_SIZE, n_rs_seq=args.n_rs_seq, n_ubatch=args.ubatch,
                  slot_order=args.slot_order, backends=devices, **kw)
