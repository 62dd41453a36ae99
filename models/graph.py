"""The llm_graph_context analogue: graph parameters, graph inputs with set_input/can_reuse, the
graph result that reuse keeps, build_inp_rs, build_rs and the one build_conv_state_store.

A model's graph builder receives a GraphContext and returns its output tensors by name."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import minigraph as mg
from minigraph.backend import HostBackend

from .conv_state import build_slot_rev, conv_state_store, slot_order_tail

SLOT_ORDERS = ("per-layer", "shared-first-layer", "host-input")


class ReuseVerdict:
    """The answer to "can the previous graph be reused?", usable as a bool (true: reuse it) that
    also says why not: `reason` names the first reuse rule that failed, e.g. "ubatch shape:
    n_tokens 1 -> 2" or "head: 0 -> 1" ("" when the graph can be reused)."""
    __slots__ = ("reason",)

    def __init__(self, reason: str = ""):
        self.reason = reason

    def __bool__(self) -> bool:
        return not self.reason

    def __eq__(self, other) -> bool:
        if isinstance(other, (bool, ReuseVerdict)):
            return bool(self) == bool(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return "ReuseVerdict(reusable)" if self else f"ReuseVerdict({self.reason!r})"

    @classmethod
    def of(cls, answer, rule: str) -> "ReuseVerdict":
        """A verdict from what a can_reuse returned: a verdict as it is, a plain bool (older
        inputs) as "reusable" or "`rule` said no"."""
        if isinstance(answer, ReuseVerdict):
            return answer
        return cls("" if answer else f"{rule} said no")


REUSABLE = ReuseVerdict()


def _differs(rule: str, old, new) -> ReuseVerdict:
    """The verdict of one rule comparing what the graph was built for (old) with what is asked (new)."""
    return REUSABLE if old == new else ReuseVerdict(f"{rule}: {old} -> {new}")


@dataclass
class GraphParams:
    """What a graph was built for (llm_graph_params); reuse compares two of these."""
    arch: str
    ubatch: object
    mctx: object                 # the recurrent memory (rebound on every reuse)
    n_rs_seq: int
    slot_order: str
    n_outputs: int
    # copies of the cache rows a node reads and overwrites in place, made just before it, for the
    # undo journal (build_rs); on when the runner's journal takes them (failure atomicity "rows")
    side_copies: bool = False

    def allow_reuse(self, other: "GraphParams") -> ReuseVerdict:
        """llama.cpp's allow_reuse: same ubatch shape, same unique seq ids (equal splits),
        same outputs, same architecture and graph-shaping parameters. The verdict names the
        first rule that fails (falsy), in the order checked below."""
        a, b = self.ubatch, other.ubatch
        for field_name in ("equal_seqs", "n_tokens", "n_seq_tokens", "n_seqs", "n_seqs_unq"):
            v = _differs(f"ubatch shape ({field_name})", getattr(a, field_name), getattr(b, field_name))
            if not v:
                return v
        if a.equal_seqs and list(a.seq_id_unq) != list(b.seq_id_unq):
            return ReuseVerdict(f"ubatch sequences: {list(a.seq_id_unq)} -> {list(b.seq_id_unq)}")
        for rule, old, new in (("outputs", self.n_outputs, other.n_outputs), ("params (arch)", self.arch, other.arch),
                               ("params (n_rs_seq)", self.n_rs_seq, other.n_rs_seq),
                               ("params (slot order)", self.slot_order, other.slot_order),
                               ("params (side copies)", self.side_copies, other.side_copies)):
            v = _differs(rule, old, new)
            if not v:
                return v
        return REUSABLE


class GraphInput:
    """A graph input: filled from the ubatch before every compute; says whether a graph built
    for other params can be reused for these."""

    def set_input(self, ubatch):
        raise NotImplementedError

    def can_reuse(self, params: GraphParams) -> ReuseVerdict:
        """Truthy when this input fits params; a falsy ReuseVerdict says which rule failed (a
        plain bool is accepted too)."""
        raise NotImplementedError


def write_input(t: mg.Tensor, values):
    """Write a graph input's values for this step: a sequence (or 1-D array) of its element
    count, in memory order, converted as NumPy assigns. On a host backend straight into the
    input's kept flat view (HostBackend.flat_view: one NumPy call), else through Tensor.set."""
    be = t.backend
    flat = be.flat_view(t) if isinstance(be, HostBackend) else None
    if flat is None:
        t.set(np.asarray(values, t.type.np_dtype).reshape(t.storage_shape))
        return
    if len(values) != flat.size:        # NumPy would broadcast a single value silently
        raise mg.OpError(f"set {t.label}: {len(values)} values for its {flat.size} elements")
    flat[:] = values


class InputTokens(GraphInput):
    def __init__(self, tokens: mg.Tensor):
        self.tokens = tokens

    def set_input(self, ubatch):
        write_input(self.tokens, ubatch.token)

    def can_reuse(self, params):
        return _differs("tokens (n_tokens)", self.tokens.ne[0], params.ubatch.n_tokens)


class InputPos(GraphInput):
    """llm_graph_input_pos: each token's position (what rope rotates by)."""

    def __init__(self, pos: mg.Tensor):
        self.pos = pos

    def set_input(self, ubatch):
        write_input(self.pos, ubatch.pos)

    def can_reuse(self, params):
        return _differs("pos (n_tokens)", self.pos.ne[0], params.ubatch.n_tokens)


class InputRS(GraphInput):
    """llm_graph_input_rs: s_copy [n_rs] and its two views, head and rs_z captured at build time
    (they are baked into byte offsets of cache views), and the host-filled slot order (llama.cpp's later slot-order input) when
    the host-input strategy asks for it."""

    def __init__(self, s_copy, s_copy_main, s_copy_tail, head, rs_z, mctx):
        self.s_copy, self.s_copy_main, self.s_copy_tail = s_copy, s_copy_main, s_copy_tail
        self.head, self.rs_z, self.mctx = head, rs_z, mctx
        self.s_slot_rev: mg.Tensor | None = None       # host-input strategy only
        self.shared_slot_rev: mg.Tensor | None = None    # shared-first-layer strategy only

    def set_input(self, ubatch):
        # s_copy(i) consumes a pending rollback: the next read comes from plane k
        write_input(self.s_copy, [self.mctx.s_copy(i) for i in range(self.s_copy.ne[0])])
        if self.s_slot_rev is not None:
            write_input(self.s_slot_rev, range(self.s_slot_rev.ne[0] - 1, -1, -1))

    def can_reuse(self, params):
        self.mctx = params.mctx                          # rebind first, as llama.cpp does
        n_rs, n_seqs = params.mctx.get_n_rs(), params.ubatch.n_seqs
        for rule, old, new in (("n_rs", self.s_copy.ne[0], n_rs), ("n_rs (main)", self.s_copy_main.ne[0], n_seqs),
                               ("n_rs (tail)", self.s_copy_tail.ne[0], n_rs - n_seqs),
                               ("head", self.head, params.mctx.get_head()),
                               ("rs_z", self.rs_z, params.mctx.get_rs_z())):
            v = _differs(rule, old, new)
            if not v:
                return v
        return REUSABLE


def output_rows(ubatch) -> list[int]:
    """The ubatch rows whose logits the graph computes (llama.cpp's out_ids): the tokens flagged
    as outputs, in ubatch order. A ubatch with none (an early part of a long prompt whose last
    token comes later) still computes its last row, which the runner drops: a graph always has
    a logits tensor of at least one row."""
    rows = [j for j, o in enumerate(ubatch.output) if o]
    return rows or [ubatch.n_tokens - 1]


class InputOutIds(GraphInput):
    """llm_graph_input_out_ids: the rows of the ubatch that go through the output norm and head."""

    def __init__(self, out_ids: mg.Tensor):
        self.out_ids = out_ids

    def set_input(self, ubatch):
        write_input(self.out_ids, output_rows(ubatch))

    def can_reuse(self, params):
        return _differs("out_ids (n_outputs)", self.out_ids.ne[0], len(output_rows(params.ubatch)))


@dataclass
class GraphResult:
    """llm_graph_result: the graph, its inputs and outputs, and what scheduled it."""
    params: GraphParams
    gf: mg.Graph
    inputs: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)
    sched: object = None
    copy_stats: tuple = (0, 0)      # (copies, bytes) per compute
    # cache tensor -> build_rs's gather of it ([state_size, n_seqs], kept to the graph's end): row q
    # holds cache row s_copy_main[q] as it was before the graph wrote anything (the undo journal
    # restores from it instead of copying those rows first; models/step_journal.py)
    witnesses: dict = field(default_factory=dict)
    # the undo journal's lookups for this graph, made once and kept while the graph is reused:
    # a deferred row run -> the host bytes of the witness that holds it, or None (StepJournal.bind)
    witness_bytes: dict = field(default_factory=dict)

    def can_reuse(self, params: GraphParams) -> ReuseVerdict:
        """Truthy when this graph can run params' ubatch; else the first failed rule's verdict."""
        verdict = self.params.allow_reuse(params)
        if not verdict:
            return verdict
        for inp in self.inputs:          # every input is asked, so every one rebinds its mctx
            v = ReuseVerdict.of(inp.can_reuse(params), type(inp).__name__)
            if verdict and not v:
                verdict = v              # the first failure is the reason
        if verdict:
            self.params = params
        return verdict

    def set_inputs(self, ubatch):
        for inp in self.inputs:
            inp.set_input(ubatch)


class GraphContext:
    """What a model's graph builder uses: ctx0 and gf to build into, the ubatch, the memory,
    the input builders and the recurrent-state helpers."""

    def __init__(self, params: GraphParams, res: GraphResult):
        if params.slot_order not in SLOT_ORDERS:
            raise ValueError(f"unknown slot order {params.slot_order!r}; choose one of {SLOT_ORDERS}")
        self.params = params
        self.res = res
        self.ctx0 = mg.Context()
        self.gf = res.gf
        self.ubatch = params.ubatch
        self.mctx = params.mctx
        self.n_rs_seq = params.n_rs_seq
        self.n_tokens = params.ubatch.n_tokens
        self.n_seq_tokens = params.ubatch.n_seq_tokens
        self.n_seqs = params.ubatch.n_seqs

    # -- inputs -------------------------------------------------------------------------------
    def build_inp_tokens(self) -> mg.Tensor:
        t = self.ctx0.new_tensor_1d(mg.i32, self.n_tokens).set_name("inp_tokens").set_input()
        self.res.inputs.append(InputTokens(t))
        return t

    def build_inp_out_ids(self) -> mg.Tensor | None:
        """The ubatch rows whose logits are wanted [n_outputs] i32 (llama.cpp's inp_out_ids), or
        None when every row is (nothing to select)."""
        n_outputs = len(output_rows(self.ubatch))
        if n_outputs == self.n_tokens:
            return None
        t = self.ctx0.new_tensor_1d(mg.i32, n_outputs).set_name("inp_out_ids").set_input()
        self.res.inputs.append(InputOutIds(t))
        return t

    def build_inp_pos(self) -> mg.Tensor:
        """The positions of the ubatch's tokens [n_tokens] i32 (llama.cpp's inp_pos); built once
        per graph, so every attention layer that asks shares it."""
        if getattr(self, "_inp_pos", None) is not None:
            return self._inp_pos
        t = self._inp_pos = self.ctx0.new_tensor_1d(mg.i32, self.n_tokens).set_name("inp_pos").set_input()
        self.res.inputs.append(InputPos(t))
        return t

    def build_inp_rs(self) -> InputRS:
        n_rs, n_seqs = self.mctx.get_n_rs(), self.n_seqs
        s_copy = self.ctx0.new_tensor_1d(mg.i32, n_rs).set_name("inp_s_copy").set_input()
        main = mg.view_1d(s_copy, n_seqs, 0).set_name("inp_s_copy_main")
        tail = mg.view_1d(s_copy, n_rs - n_seqs, n_seqs * s_copy.type.size).set_name("inp_s_copy_tail")
        inp = InputRS(s_copy, main, tail, self.mctx.get_head(), self.mctx.get_rs_z(), self.mctx)
        self.res.inputs.append(inp)
        return inp

    def build_attn_inp_kv(self, causal: bool = True):
        """The attention layers' inputs (k_idxs, v_idxs, kq_mask) over the hybrid memory's KV cache."""
        from .attn_inputs import build_attn_inp_kv       # attn_inputs builds on this module
        kv = getattr(self.mctx, "kv", None)
        if kv is None:
            raise ValueError(f"{self.params.arch}: the graph has attention layers but the memory "
                             f"{type(self.mctx).__name__} has no KV cache (rule: use a HybridMemory)")
        return build_attn_inp_kv(self, kv, causal)

    # -- recurrent state ----------------------------------------------------------------------
    def build_rs(self, inp: InputRS, s: mg.Tensor, state_size: int, n_seqs: int,
                 get_state_rows: Callable | None = None) -> mg.Tensor:
        """Read the ubatch's states ([state_size, n_seqs]) from the cache s, as llama.cpp's build_rs does:
        zero the rs_z row first, gather by s_copy_main (any plane), move the tail cells."""
        gf = self.gf
        states = mg.reshape_2d(s, state_size, s.ne[1])          # all mem_size*K rows
        z = inp.rs_z
        zero = mg.view_1d(states, state_size * (z >= 0), z * states.nb[1] * (z >= 0))
        gf.build_forward_expand(mg.scale_inplace(zero, 0.0))
        if get_state_rows is not None and self.params.side_copies and s.view_src is None:
            # the reader reads the rows in place and the graph then overwrites them (mamba2's
            # ssm_scan): a copy of them, made just before the reader, is the undo journal's copy
            # (instead of one the journal makes before the compute), and the reader then finds
            # the rows in the cache rather than in memory
            copy = mg.get_rows(states, inp.s_copy_main).set_side_copy()
            gf.build_forward_expand(copy)
            self.res.witnesses[s] = copy
        fn = get_state_rows or (lambda ctx, st, ids: mg.get_rows(st, ids))
        out = fn(self.ctx0, states, inp.s_copy_main)
        if get_state_rows is None and s.view_src is None and out.type == s.type:
            # a plain gather is a byte copy of the rows it reads: in memory of its own for the whole
            # compute, it is the undo journal's copy of them for free (whole graph: the journal's
            # stamp, written before the compute, stays there until the gather runs)
            self.res.witnesses[s] = out.set_whole_graph()
        gf.build_forward_expand(out)
        n_extra = inp.s_copy.ne[0] - n_seqs
        if n_extra > 0:
            extra = mg.get_rows(states, inp.s_copy_tail)
            dst = mg.view_2d(s, state_size, n_extra, s.nb[1], (inp.head + n_seqs) * s.nb[1])
            gf.build_forward_expand(mg.cpy(extra, dst))
        return out

    def build_conv_state_store(self, inp: InputRS, s: mg.Tensor, conv_x: mg.Tensor, n_cols: int, offs: int = 0):
        """The one place conv history is written (llama.cpp's shared conv-state store), with this
        graph's slot order."""
        slot_order = None
        if self.n_rs_seq > 0:
            K = self.n_rs_seq + 1
            Kw = min(conv_x.ne[0] - n_cols, K)
            slot_order = self._slot_order(inp, K, Kw)
        conv_state_store(self.gf, s, conv_x, n_cols, offs, inp.head, self.mctx.get_size(),
                         self.n_rs_seq, slot_order=slot_order)

    def _slot_order(self, inp: InputRS, K: int, Kw: int) -> mg.Tensor | None:
        strategy = self.params.slot_order
        if strategy == "per-layer":
            return None                      # conv_state_store builds it next to its set_rows
        if strategy == "shared-first-layer":
            # the layout llama.cpp's conv-state refactor replaced: one order, built where the first
            # conv layer is; each layer views its own tail, so each layer on another device copies it
            if inp.shared_slot_rev is None:
                inp.shared_slot_rev = build_slot_rev(self.ctx0, K)
            return slot_order_tail(inp.shared_slot_rev, Kw)
        if inp.s_slot_rev is None:           # host-input: one I32 input, filled by the host, for all layers
            inp.s_slot_rev = self.ctx0.new_tensor_1d(mg.i32, Kw).set_name("rs_s_slot_rev").set_input()
        return inp.s_slot_rev

    def build_state_store(self, inp: InputRS, s: mg.Tensor, packed: mg.Tensor, state_offs: int, D: int):
        """Store the K state snapshots an op packs after its main output (ssm_scan,
        gated_delta_net: slot j = state j tokens back, slot-major then seq) into the s cache:
        slot j of seq q -> row j*mem_size + head + q, for j < min(T, K) (slot 0 is the newest state)."""
        K = self.n_rs_seq + 1
        S = self.n_seqs
        n_written = min(self.n_seq_tokens, K)
        elt = packed.type.size
        src = mg.view_3d(packed, D, S, n_written, D * elt, D * elt * S, state_offs)
        dst = mg.view_3d(s, D, S, n_written, s.nb[1], self.mctx.get_size() * s.nb[1], inp.head * s.nb[1])
        # nothing else reads the packed slots: a backend may write them into the cache directly
        self.gf.build_forward_expand(mg.cpy(src, dst).set_state_store())
