"""The memory a command will need, estimated before anything big is allocated, and what the
machine has: a run that would not fit is refused with the figures (exit status 2) instead of
being killed by the kernel's out-of-memory killer halfway through.

What is counted (f32 everywhere):
  weights         measured on a one- and a two-layer probe of the model, scaled to n_layer
  recurrent state n_layer x mem_size x (n_rs_seq + 1) rows x (n_embd_r + n_embd_s of the widest
                  layer) x 4 bytes,
                  once per runner the command makes (run: 2, reuse: 3) plus one full copy per
                  runner that validates or snapshots
  compute         n_ubatch tokens x (n_vocab + 16 n_embd) x 4 bytes x 4 (activations, logits)
The estimate is meant to be within a small factor: enough to refuse a run that wants 20 GiB on
a machine with 8, not to account for every byte."""
from __future__ import annotations

from dataclasses import dataclass

from minigraph.alloc import available_bytes, human_bytes

MEM_SIZE = 2          # the cells the commands give each runner's memory (session.make_runner)
F32 = 4


@dataclass
class Estimate:
    weights: int
    state: int            # one runner's recurrent state
    compute: int
    runners: int
    state_copies: int     # full copies of the state (snapshots) on top of the runners' own

    @property
    def total(self) -> int:
        return self.weights + self.state * (self.runners + self.state_copies) + self.compute

    def describe(self) -> str:
        return (f"weights {human_bytes(self.weights)}, recurrent state {human_bytes(self.state)} "
                f"x {self.runners + self.state_copies}, compute {human_bytes(self.compute)}")


def _probe(make_probe, n_layer: int):
    import minigraph as mg
    model = make_probe(mg.backend("ref"), n_layer)
    weights = sum(t.nbytes() for t in model.gguf_tensors().values())
    # the widest layer's row: a hybrid probe's attention layers keep no recurrent row, so a
    # difference of the two probes' sums could be 0; every layer counted as the widest is an upper bound
    row = max(sum(_width(model, w, il) for w in ("n_embd_r", "n_embd_s")) for il in model.layers)
    return weights, row, model


def _width(model, attr: str, il: int) -> int:
    v = getattr(model, attr, 0)
    return int(v(il) if callable(v) else v)


def estimate(make_probe, n_layer: int, n_rs_seq: int, n_ubatch: int, runners: int,
             state_copies: int = 0) -> Estimate:
    """make_probe(device, n_layer) -> a small model of the same kind (one and two layers are
    built to separate the per-layer weights from the embedding and head)."""
    w1, row1, m = _probe(make_probe, 1)
    w2, row2, _ = _probe(make_probe, 2)
    per_layer_w, per_layer_row = w2 - w1, max(row1, row2)
    weights = w1 + (n_layer - 1) * per_layer_w
    state = n_layer * MEM_SIZE * (n_rs_seq + 1) * per_layer_row * F32
    compute = n_ubatch * (m.n_vocab + 16 * m.n_embd) * F32 * 4
    return Estimate(weights, state, compute, runners, state_copies)


def check(est: Estimate, max_memory: int | None, culprits: str) -> None:
    """Refuse (exit 2) when the estimate exceeds --max-memory or what the machine has."""
    from .errors import fail
    limits = []
    if max_memory is not None:
        limits.append((max_memory, "--max-memory"))
    avail, source = available_bytes()
    if avail is not None:
        limits.append((avail, f"the {source}"))
    for limit, what in limits:
        if est.total > limit:
            fail(f"this run needs about {human_bytes(est.total)} ({est.describe()}), more than "
                 f"{what} of {human_bytes(limit)}; lower {culprits}")
