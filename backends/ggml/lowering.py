"""How a minigraph node becomes a ggml tensor: each op's `GgmlCall` (minigraph.registry),
interpreted against whichever ggml library is loaded.

One copy, used by both the op oracle (minigraph.testing.ggml_oracle, ggml 0.20.2 from
libggml-python) and the ggml backend (this package, the ggml that llama.cpp installs). Nothing
here loads a library: the caller passes its cffi `ffi` and library object to `GgmlBuilder`."""
from __future__ import annotations

from minigraph.registry import OPS, GgmlCall, NotInGgml

T = "struct ggml_tensor *"

# the tensor struct (same layout in ggml 0.20 and 0.25; each loader checks it against
# ggml_tensor_overhead()) and the constructors every lowering calls
CDEF_TENSOR = f"""
struct ggml_context;
struct ggml_cgraph;
struct ggml_init_params {{ size_t mem_size; void * mem_buffer; bool no_alloc; }};
struct ggml_tensor {{
    int type; void * buffer; int64_t ne[4]; size_t nb[4]; int op; int32_t op_params[16];
    int32_t flags; struct ggml_tensor * src[10]; struct ggml_tensor * view_src; size_t view_offs;
    void * data; char name[64]; void * extra; char padding[8];
}};
struct ggml_context * ggml_init(struct ggml_init_params params);
void ggml_free(struct ggml_context * ctx);
size_t ggml_tensor_overhead(void);
size_t ggml_graph_overhead_custom(size_t size, bool grads);
size_t ggml_nbytes(const struct ggml_tensor * t);
struct ggml_cgraph * ggml_new_graph_custom(struct ggml_context * ctx, size_t size, bool grads);
void ggml_build_forward_expand(struct ggml_cgraph * g, {T} t);
int ggml_graph_n_nodes(struct ggml_cgraph * g);
{T} ggml_graph_node(struct ggml_cgraph * g, int i);
{T} ggml_new_tensor(struct ggml_context * ctx, int type, int n_dims, const int64_t * ne);
"""

_DEFAULT_CTYPE = {float: "float", int: "int", bool: "bool", tuple: "int"}


def call_arg_ctypes(d, call: GgmlCall) -> list:
    """The C types of a GgmlCall's arguments (after ctx), from the op's sources and params."""
    out = []
    for name in call.args:
        if name == "@ne":
            out += ["int64_t"] * 4
        elif name in d.srcs:
            out.append(T)
        elif name in d.params:
            ctype = call.ctypes.get(name, _DEFAULT_CTYPE.get(d.params[name]))
            if ctype is None:
                raise TypeError(f"{d.name}: ggml argument '{name}' has no C type (param type {d.params[name]})")
            out += [ctype] * (4 if d.params[name] is tuple else 1)
        else:
            raise TypeError(f"{d.name}: ggml argument '{name}' is neither a source, a param nor '@ne'")
    return out


def cdef_for_ops(ops=None) -> str:
    """The declarations of every ggml constructor the ops' GgmlCalls use (and their _inplace
    variants where the op has an `inplace` param), one per function."""
    decls = {}
    for d in (OPS if ops is None else ops).values():
        call = d.ggml
        if not isinstance(call, GgmlCall):
            continue
        if call.override is not None:
            decls[f"override:{d.name}"] = call.cdef
            continue
        args = "".join(f", {t} x{i}" for i, t in enumerate(call_arg_ctypes(d, call)))
        for sfx in ("", "_inplace") if "inplace" in d.params else ("",):
            decls[call.fn + sfx] = f"{T} ggml_{call.fn}{sfx}(struct ggml_context * ctx{args});\n"
    return "".join(decls.values())


def constructor_names(ops=None) -> list[str]:
    """The ggml functions the ops' plain GgmlCalls name (a loader checks each is exported)."""
    names = set()
    for d in (OPS if ops is None else ops).values():
        call = d.ggml
        if isinstance(call, GgmlCall) and call.override is None and call.fn:
            names.add(f"ggml_{call.fn}")
            if "inplace" in d.params:
                names.add(f"ggml_{call.fn}_inplace")
    return sorted(names)


class GgmlBuilder:
    """What an override sees: ``call(fn, *args, inplace=False)`` runs ggml_<fn>[_inplace](ctx,
    *args); ``lib`` and ``ffi`` for anything else."""

    def __init__(self, ctx, lib, ffi):
        self.ctx, self.lib, self.ffi = ctx, lib, ffi

    def call(self, fn: str, *args, inplace: bool = False):
        return getattr(self.lib, f"ggml_{fn}{'_inplace' if inplace else ''}")(self.ctx, *args)


def translation_problem(opname: str) -> str | None:
    """None when op ``opname`` can be built in ggml, else why not."""
    d = OPS[opname]
    if isinstance(d.ggml, NotInGgml):
        return f"{opname} is not in ggml: {d.ggml.reason}"
    if not isinstance(d.ggml, GgmlCall):
        return f"{opname} declares no ggml translation (OpDef.ggml)"
    if d.ggml.override is None and not d.ggml.fn:
        return f"{opname}: GgmlCall names no function and no override"
    return None


def translate(g: GgmlBuilder, node, src):
    """The ggml tensor for ``node``; ``src(name)`` gives a source's ggml tensor."""
    d = OPS[node.op]
    call = d.ggml
    if call.override is not None:
        return call.override(g, node, src)
    args = []
    for name in call.args:
        if name == "@ne":
            args += list(node.ne)
        elif name in d.srcs:
            args.append(src(name) if name in node.srcs else g.ffi.NULL)
        elif d.params[name] is tuple:
            args += list(node.params[name])
        else:
            args.append(node.params[name])
    return g.call(call.fn, *args, inplace=bool(node.params.get("inplace")))


def layout_mismatch(t, g, ffi, offsets: bool = True) -> str | None:
    """None when the ggml tensor ``g`` has minigraph tensor ``t``'s type, extents, strides and
    (with ``offsets``) view offset; else the difference in words."""
    got = (g.type, tuple(g.ne), tuple(g.nb), g.view_offs if g.view_src != ffi.NULL else 0)
    want = (t.type.ggml_id, t.ne, t.nb, t.view_offs)
    if not offsets:
        got, want = got[:3], want[:3]
    if got == want:
        return None
    return f"{t.op} {t.label}: ggml made (type, ne, nb, view_offs) = {got}, minigraph {want}"
