"""minigraph quantize: write a model as a GGUF file of one file type (F16, BF16, Q8_0, Q4_0 or
Q4_K_M, each weight's type chosen as llama.cpp's quantizer does: models/gguf_types.py), from a
zoo model (seeded) or from an f32 GGUF file."""
from __future__ import annotations

import os

from .args import int_at_least
from .errors import fail


def add_parser(sub):
    from minigraph.models.gguf_types import FILE_TYPES
    from minigraph.models.zoo import MODELS
    p = sub.add_parser("quantize", help="write a model as an F16, BF16, Q8_0, Q4_0 or Q4_K_M GGUF file",
                       description="Write a zoo model (seeded random weights) or the model of an f32 GGUF "
                       "file in one file type; 1-D tensors, norms and conv kernels stay f32, and the "
                       "K-quant mix follows llama.cpp's Q4_K_M rule.")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help=f"a zoo model ({', '.join(MODELS)}); omit it with --gguf")
    p.add_argument("--gguf", default=None, metavar="FILE", help="read the model and its f32 weights from this file")
    p.add_argument("--out", required=True, metavar="FILE", help="the GGUF file to write")
    p.add_argument("--type", required=True, choices=list(FILE_TYPES), metavar="TYPE",
                   help=f"the file type: {', '.join(FILE_TYPES)}")
    p.add_argument("--layers", type=int_at_least(1), default=None, help="number of layers of a zoo model")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of a zoo model's weights (default 0)")
    p.set_defaults(fn=cmd_quantize)


def cmd_quantize(args):
    import minigraph as mg
    from minigraph.models.gguf_io import GGUFError, save_gguf
    from minigraph.models.zoo import UsageError, make_model
    if (args.model is None) == (args.gguf is None):
        fail("name a zoo MODEL or give --gguf FILE (one of the two)")
    if args.gguf and not os.path.isfile(args.gguf):
        fail(f"--gguf {args.gguf}: no such file")
    if args.gguf and args.layers is not None:
        fail("--layers: not allowed with --gguf (the file sets the number of layers)")
    kw = {} if args.layers is None else {"n_layer": args.layers}
    try:
        model = make_model(args.model, [mg.backend("ref")], seed=args.seed, gguf=args.gguf, **kw)
        path = save_gguf(model, args.out, ftype=args.type)
    except (UsageError, GGUFError, ValueError, mg.OpError) as e:
        fail(str(e))
    print(f"wrote {path} ({os.path.getsize(path)} bytes, file type {args.type})")
    return 0
