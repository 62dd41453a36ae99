"""The decode runner (llama_context::decode in small): split a batch into ubatches, find a slot,
build or reuse the graph, schedule, set inputs, compute; speculative drafts with rollback.

Graph reuse follows llama.cpp's can_reuse: the previous graph is reused when its params
allow it and every input agrees; on reuse only set_input runs — the graph, its schedule, the
memory plan and the backends' plans are all kept. MINIGRAPH_GRAPH_REUSE=0 disables reuse;
MINIGRAPH_GRAPH_REUSE_CHECK=1 (or validate=True) recomputes every reused step from a fresh build
on the same starting memory and raises ReuseMismatch on the first differing byte.

Failure atomicity (`atomic`, on by default): a step — `decode` (all its ubatches) or
`speculative_step` (the draft and its rollback) — that raises leaves the memory's cells and state
bytes exactly as they were before it. An undo journal (models/step_journal.py) copies the cell
metadata and, before each ubatch computes, only the cache rows that ubatch may write (none of those
its graph's own gathers already hold: Stats.witnessed_bytes); `atomic="full"`
copies the whole cache instead (the old way, for comparison), `atomic=False` copies nothing."""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

import minigraph as mg
from minigraph import env
from minigraph.sched import is_view_op

from .batch import Batch, BatchAllocr
from .graph import SLOT_ORDERS, GraphContext, GraphParams, GraphResult, ReuseVerdict, output_rows
from .hybrid_memory import HybridMemory
from .k_shift import apply_k_shift, check_can_shift
from .kv_cache import KVCache
from .memory import RecurrentMemory
from .step_journal import JOURNALS

log = logging.getLogger("minigraph.runner")


class ReuseMismatch(AssertionError):
    """A reused graph computed something a fresh build does not."""


class DecodeError(RuntimeError):
    pass


class NoSlot(DecodeError):
    """The memory refused a ubatch (find_slot): nothing was placed or computed, so the previous
    graph stays usable."""


@dataclass
class Stats:
    builds: int = 0
    reuses: int = 0
    ubatches: int = 0
    tokens: int = 0
    rollbacks: int = 0
    rollbacks_refused: int = 0
    validated: int = 0
    host_s_build: float = 0.0        # graph build + schedule + memory plan (rebuilt steps)
    host_s_reuse: float = 0.0        # reuse check (reused steps)
    copies: list = field(default_factory=list)      # per ubatch: (n copies, bytes)
    steps: int = 0                   # atomic steps run (decode / speculative_step calls)
    rebuild_reasons: list = field(default_factory=list)   # per build, why the previous graph was not reused
    snapshot_bytes: int = 0          # state bytes the undo journals copied, all steps together
    witnessed_bytes: int = 0         # state bytes they left to the graphs' own gathers instead


def clamp_n_rs_seq(model, n_rs_seq: int) -> int:
    """llama.cpp's clamp of n_rs_seq: rollback needs an architecture that supports it and a causal model."""
    if n_rs_seq > 0 and (not getattr(model, "supports_rollback", False) or not getattr(model, "causal", True)):
        why = "does not support recurrent partial rollback" if not getattr(model, "supports_rollback", False) \
            else "is not causal"
        log.info("n_rs_seq=%d requested but model %s %s; clamping to 0", n_rs_seq, model.arch, why)
        return 0
    return n_rs_seq


ATOMIC_MODES = {True: "rows", "rows": "rows", "full": "full", False: None, None: None}


def atomic_mode(atomic) -> str | None:
    """True/"rows" -> "rows" (copy what each ubatch may write), "full" -> "full" (copy the whole
    cache), False/None -> None (no guarantee, no copy)."""
    try:
        return ATOMIC_MODES[atomic]
    except (KeyError, TypeError):
        raise ValueError(f"Runner: atomic={atomic!r} is not one of True, False, 'rows', 'full'") from None


def default_backends(model) -> list:
    """The model's devices in priority order: layer devices first, the host (last) at the end."""
    seen = []
    for d in list(model.layer_devices) + [model.host]:
        if d not in seen:
            seen.append(d)
    if model.host in seen:
        seen.remove(model.host)
        seen.append(model.host)
    return seen


def node_by_node(res: GraphResult) -> list:
    """Compute res's graph one node at a time on its devices, as its schedule says (a split's
    inputs are copied in first); returns (label, op, values) per computed node, in graph order."""
    sched = res.sched
    sg = sched.alloc_graph(res.gf)
    out = []
    with sg.reading():
        for sp in sg.splits:
            dst = sched.backends[sp.backend]
            sched.copy_inputs(sg, sp)
            for n in sp.nodes:
                dst.compute_nodes([n])           # a fresh one-node list: its own plan, no cache
                if is_view_op(n):
                    continue                     # views compute nothing of their own
                buf, _ = n.storage()
                out.append((n.name or n.label, n.op, np.array(buf.backend.read_tensor(n))))
    return out


DEFAULT_KV_SIZE = 256


def make_memory(model, mem_size: int, n_rs_seq: int, kv_size: int | None = None, kv_pad: int | None = None):
    """The model's memory: a RecurrentMemory, or for a model with attention layers a HybridMemory
    (its recurrent layers in a RecurrentMemory of mem_size cells, its attention layers in a KV
    cache of kv_size cells), each layer's tensors on that layer's device."""
    attn = [il for il in model.layers if il in getattr(model, "attn_layers", ())]
    rec_layers = [il for il in model.layers if il not in attn]
    rec = RecurrentMemory(rec_layers, model.n_embd_r, model.n_embd_s, mem_size, n_rs_seq,
                          {il: model.layer_devices[il] for il in rec_layers})
    if not attn:
        return rec
    pad = {} if kv_pad is None else {"n_pad": kv_pad}       # KVCache's own default otherwise
    kv = KVCache(attn, model.n_embd_k_gqa, model.n_embd_v_gqa, kv_size or DEFAULT_KV_SIZE,
                 {il: model.layer_devices[il] for il in attn}, n_seq_max=mem_size, **pad)
    return HybridMemory(rec, kv)


class Runner:
    def __init__(self, model, *, mem_size: int = 4, n_rs_seq: int = 0, n_ubatch: int = 8,
                 slot_order: str = "per-layer", backends=None, reuse: bool | None = None,
                 validate: bool | None = None, atomic: bool | str = True, kv_size: int | None = None,
                 kv_pad: int | None = None):
        if slot_order not in SLOT_ORDERS:
            raise ValueError(f"unknown slot order {slot_order!r}; choose one of {SLOT_ORDERS}")
        self.model = model
        self.n_rs_seq = clamp_n_rs_seq(model, n_rs_seq)
        self.K = self.n_rs_seq + 1
        if self.n_rs_seq > 0 and n_ubatch < self.n_rs_seq + 2:
            n_ubatch = self.n_rs_seq + 2           # split_equal needs n_ubatch > n_keep_tail
        self.n_ubatch = n_ubatch
        self.slot_order = slot_order
        self.backends = list(backends) if backends else default_backends(model)
        # kv_size: cells of the KV cache of a model with attention layers (ignored otherwise);
        # kv_pad: the attended cells n_kv are a multiple of it (a graph is rebuilt when n_kv grows;
        # llama.cpp pads to 256, KVCache's default is small for the small test caches)
        self.memory = make_memory(model, mem_size, self.n_rs_seq, kv_size, kv_pad)
        self.reuse = env.get("MINIGRAPH_GRAPH_REUSE") if reuse is None else reuse
        self.validate = env.get("MINIGRAPH_GRAPH_REUSE_CHECK") if validate is None else validate
        self.atomic = atomic_mode(atomic)
        self._journal = None             # the undo journal of the step in progress
        self.prev: GraphResult | None = None
        self.no_prev_reason = "first graph"   # why prev is None (a rebuild's reason then)
        self.stats = Stats()

    def forget_graph(self, reason: str):
        """Drop the previous graph: the next ubatch is built afresh, and `reason` is the rebuild's."""
        self.prev = None
        self.no_prev_reason = reason

    # -- one ubatch -------------------------------------------------------------------------
    def _build(self, params: GraphParams) -> GraphResult:
        res = GraphResult(params, mg.Graph())
        g = GraphContext(params, res)
        res.outputs = self.model.build(g)
        res.sched = mg.Scheduler(self.backends)
        res.sched.alloc_graph(res.gf)
        res.copy_stats = res.sched.scheduled.copy_stats()   # per compute, fixed for the graph
        return res

    def _state_bytes(self) -> dict:
        return {t.name: t.numpy().tobytes() for t in self.memory.tensors()}   # r/s (and K/V) caches

    def live_state_bytes(self) -> bytes:
        """Every layer's live recurrent state (plane 0 of its r and s caches), in layer order: what
        two runs that saw the same accepted tokens must hold byte for byte (the state check)."""
        out = b""
        for il in self.model.layers:
            for t in (self.memory.r_l.get(il), self.memory.s_l.get(il)):
                if t is not None:
                    out += t.numpy()[: self.memory.size].tobytes()
        return out

    @contextmanager
    def step(self):
        """One failure-atomic step: the memory is restored if the body raises. Steps nest: an
        inner one (decode inside speculative_step, process_ubatch inside decode) joins the outer
        one's journal, so the whole outer step is undone."""
        if self._journal is not None or self.atomic is None:
            yield self._journal
            return
        # the validator recomputes a reused graph from restored memory: the journal copies then
        journal = JOURNALS[self.atomic](self.memory, defer=not self.validate)
        self._journal = journal
        try:
            yield journal
        except BaseException as err:
            journal.undo()
            if not isinstance(err, NoSlot):
                self.forget_graph("the previous step failed and was undone")   # its inputs are stale
            raise
        finally:
            self._journal = None
            self.stats.steps += 1
            self.stats.snapshot_bytes += journal.nbytes
            self.stats.witnessed_bytes += journal.witnessed

    def process_ubatch(self, ub) -> np.ndarray:
        """Run one ubatch; returns the logits of its output tokens (ub.output) [n_outputs, n_vocab]
        in ubatch order: only those rows go through the output head. A failure leaves
        the memory (cells and state bytes) exactly as it was before the step (see `step`)."""
        with self.step() as journal:
            try:
                return self._compute_ubatch(ub, journal)
            except NoSlot:
                raise
            except BaseException:
                self.forget_graph("the previous ubatch failed")
                raise

    def _compute_ubatch(self, ub, journal) -> np.ndarray:
        if not self.memory.find_slot(ub):
            raise NoSlot(f"no memory slot for a ubatch of {ub.n_seqs} sequences: {self.memory.last_refusal}")
        if journal is not None:
            journal.before_ubatch(ub)        # the rows this graph may write, before it writes them
        params = self._params(ub)
        t0 = time.perf_counter()
        verdict = self.reuse_verdict(params)
        reused = bool(verdict)
        if reused:
            res = self.prev
            self.stats.reuses += 1
            self.stats.host_s_reuse += time.perf_counter() - t0
        else:
            self.prev = None
            res = self._build(params)
            self.stats.builds += 1
            self.stats.rebuild_reasons.append(verdict.reason)
            log.debug("graph rebuilt: %s", verdict.reason)
            self.stats.host_s_build += time.perf_counter() - t0
        before = self.memory.snapshot() if (reused and self.validate) else None
        if journal is not None:
            journal.bind(res)                # rows the graph's own gathers will hold are not copied
        res.set_inputs(ub)
        res.sched.graph_compute(res.gf)
        logits = self._read_logits(res, ub)
        if before is not None:
            self._validate(params, ub, before, logits, res)
        self.prev = res
        self.stats.copies.append(res.copy_stats)
        self.stats.ubatches += 1
        self.stats.tokens += ub.n_tokens
        return logits

    def _params(self, ub) -> GraphParams:
        return GraphParams(self.model.arch, ub, self.memory, self.n_rs_seq, self.slot_order, len(output_rows(ub)),
                           side_copies=self._side_copies(ub))

    def _side_copies(self, ub) -> bool:
        """Whether the graph of ub copies the rows a node reads and overwrites in place itself, just
        before that node (build_rs): when this runner's journal takes those copies (failure
        atomicity "rows", no validator) and ub is decode-shaped (one token per sequence). The
        journal uses them in the steps whose sequences stay in their cells (reads_rows_in_place)
        and copies as before otherwise. A longer ubatch's journal is a small part of its step, and
        its graph would hold the copies in memory of their own."""
        return self.atomic == "rows" and not self.validate and ub.n_seq_tokens == 1

    @staticmethod
    def _read_logits(res: GraphResult, ub) -> np.ndarray:
        """The logits rows of ub's outputs [n_outputs, n_vocab] (none when the ubatch has no
        output: the row the graph computed anyway is dropped)."""
        logits = res.outputs["logits"].numpy()
        logits = logits.reshape(-1, logits.shape[-1])
        return logits if any(ub.output) else logits[:0]

    def reuse_verdict(self, params: GraphParams) -> ReuseVerdict:
        """Whether the previous graph can run params' ubatch, and if not, why (see can_reuse)."""
        if not self.reuse:
            return ReuseVerdict("graph reuse is off")
        if self.prev is None:
            return ReuseVerdict(self.no_prev_reason)
        return ReuseVerdict.of(self.prev.can_reuse(params), "GraphResult.can_reuse")

    def _validate(self, params, ub, before, logits, reused):
        """Recompute the step from a fresh build on the same starting memory; compare bytes."""
        after = self._state_bytes()
        self.memory.restore(before)
        fresh = self._build(params)
        fresh.set_inputs(ub)
        fresh.sched.graph_compute(fresh.gf)
        fresh_logits = self._read_logits(fresh, ub)
        checks = [("logits", logits.tobytes(), fresh_logits.tobytes())]
        checks += [(k, after[k], v) for k, v in self._state_bytes().items()]
        for name, got, want in checks:
            if got != want:
                a, b = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
                i = int(np.argmax(a != b))
                where = self._first_differing_node(reused, fresh, ub, before)
                self.memory.restore(before)
                raise ReuseMismatch(f"graph reuse: {name} differs from a fresh build at byte {i} "
                                    f"(reused {a[i]:#04x}, fresh {b[i]:#04x}) in ubatch of "
                                    f"{ub.n_seqs}x{ub.n_seq_tokens} tokens at head {params.mctx.get_head()}"
                                    + (f"; {where}" if where else ""))
        self.stats.validated += 1

    def _first_differing_node(self, reused, fresh, ub, before) -> str:
        """Run the reused and the fresh graph node by node from the same starting memory, reading
        each node's bytes right after it runs (before the memory planner hands its memory on),
        and name the first node whose bytes differ with both values. "" when none is found."""
        if reused is None:
            return ""
        runs = []
        for res in (reused, fresh):
            self.memory.restore(before)
            res.set_inputs(ub)
            runs.append(node_by_node(res))
        for i, ((label, op, got), (_, _, want)) in enumerate(zip(*runs)):
            if got.tobytes() != want.tobytes():
                flat_a, flat_b = got.reshape(-1), want.reshape(-1)
                same_shape = flat_a.shape == flat_b.shape
                j = int(np.argmax(flat_a != flat_b)) if same_shape else 0
                return (f"first differing node #{i} {label} ({op}): element {j} reused {flat_a[j].item()!r}, "
                        f"fresh {flat_b[j].item()!r}" if same_shape else
                        f"first differing node #{i} {label} ({op}): shapes {got.shape} vs {want.shape}")
        return ""

    def schedule_only(self, seq_tokens: dict) -> GraphResult:
        """Split {seq: [tokens]}, find a slot for the first ubatch, build and schedule its graph
        without computing it: for placement reports and drawings."""
        batch = Batch.from_seqs(seq_tokens, start_pos={s: self.next_pos(s) for s in seq_tokens})
        ub = BatchAllocr(batch).split_all("equal", self.n_ubatch, sequential=True,
                                          n_keep_tail=self.K if self.n_rs_seq > 0 else 0)[0]
        if not self.memory.find_slot(ub):
            raise DecodeError(f"no memory slot for a ubatch of {ub.n_seqs} sequences")
        return self._build(self._params(ub))

    # -- batches ----------------------------------------------------------------------------
    def decode(self, batch: Batch) -> np.ndarray:
        """Decode a batch; returns the logits of its output tokens (batch.output: by default the
        batch's last token, as llama.cpp) [n_outputs, n_vocab], in the batch's token order."""
        apply_k_shift(self.model, getattr(self.memory, "kv", None), self.backends)   # a pending seq_add / seq_div
        allocr = BatchAllocr(batch)
        ubatches = allocr.split_all("equal", self.n_ubatch, sequential=True,
                                    n_keep_tail=self.K if self.n_rs_seq > 0 else 0)
        # a lone ubatch skips the dry run (a decode step's): its own find_slot, inside the step
        # that undoes it on failure, asks the memory the same question
        lone = len(ubatches) == 1
        if not lone and not self.memory.prepare(ubatches):
            raise self._refused()
        parts = []
        with self.step():                # all ubatches or none: a failure in the 2nd undoes the 1st
            for ub in ubatches:
                try:
                    parts.append(self.process_ubatch(ub))
                except NoSlot:
                    if lone:
                        raise self._refused() from None
                    raise
        logits = parts[0] if len(parts) == 1 else np.concatenate(parts)
        # the rows come in ubatch order (allocr.out_ids: their batch indices); put them in batch order
        ids = allocr.out_ids
        if all(a < b for a, b in zip(ids, ids[1:])):      # already (a decode step's one row, say)
            return logits
        return logits[np.argsort(np.asarray(ids, np.int64), kind="stable")]

    def _refused(self) -> NoSlot:
        """The error of a batch the memory cannot hold (nothing was changed)."""
        if isinstance(self.memory, HybridMemory):
            return NoSlot(f"the batch does not fit in the hybrid memory: {self.memory.last_refusal}")
        return NoSlot("the batch does not fit in the recurrent memory")

    def next_pos(self, seq: int) -> int:
        return self.memory.seq_pos_max(seq) + 1

    # -- position changes (llama_memory_seq_add / seq_div): the K shift runs before the next graph
    def seq_add(self, seq: int, p0: int, p1: int, delta: int):
        check_can_shift(self.model, f"seq_add(seq {seq}, [{p0}, {p1}), {delta:+d})")
        self.memory.seq_add(seq, p0, p1, delta)

    def seq_div(self, seq: int, p0: int, p1: int, d: int):
        check_can_shift(self.model, f"seq_div(seq {seq}, [{p0}, {p1}), /{d})")
        self.memory.seq_div(seq, p0, p1, d)

    def decode_seq_tokens(self, seq_tokens: dict, output: str = "all") -> dict:
        """Decode {seq: [tokens]} continuing each sequence; returns {seq: logits [n, n_vocab]}
        with output='all' (every token: the default, what tests compare), or [1, n_vocab] with
        output='last' (each sequence's last token only, llama.cpp's default: a prefill then pays
        the output head for one row)."""
        if output not in ("all", "last"):
            raise ValueError(f"decode_seq_tokens: output must be 'all' or 'last', got {output!r}")
        batch = Batch.from_seqs(seq_tokens, start_pos={s: self.next_pos(s) for s in seq_tokens}, output=output)
        logits = self.decode(batch)
        out, i = {}, 0
        for s, toks in seq_tokens.items():      # from_seqs lays the batch out sequence by sequence
            n = len(toks) if output == "all" else min(len(toks), 1)
            out[s] = logits[i:i + n]
            i += n
        return out

    def rollback(self, seq: int, k: int) -> bool:
        """Drop the last k tokens of seq; True if the memory could do it exactly."""
        ok = self.memory.rollback(seq, k)
        if ok:
            self.stats.rollbacks += 1
        else:
            self.stats.rollbacks_refused += 1
        return ok

    def speculative_step(self, seq: int, draft: list, n_accept: int) -> np.ndarray:
        """Decode a draft of d tokens for seq, keep the first n_accept, roll back the rest.
        Returns the logits of the accepted tokens. One step: when the decode fails or the
        rollback is refused, the draft is undone too (the memory is as before the call)."""
        with self.step():
            logits = self.decode_seq_tokens({seq: list(draft)})[seq]
            k = len(draft) - n_accept
            if k > 0 and not self.rollback(seq, k):
                raise DecodeError(f"speculative_step: rollback of {k} tokens on seq {seq} refused "
                                  f"({self.memory.last_refusal}); the draft was undone")
        return logits[:n_accept]
