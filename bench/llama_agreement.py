"""How closely minigraph's logits follow llama.cpp's, per architecture, layer pattern and K/V cache
type: the agreement table.

    python bench/llama_agreement.py            # print the table
    python bench/llama_agreement.py --write    # also (re)write its section of bench/RESULTS.md

Needs the `llama` extra (llama-cpp-python 0.3.36). For every row a tiny seeded model is written to
GGUF by minigraph (models/gguf_io.py); minigraph (load_gguf + Runner, n_rs_seq 3, ubatch 8, 1
thread) and llama.cpp (a worker process, 1 thread, flash attention off) make the same calls on the
file (minigraph.testing.llama_calls): a prefill of 11 tokens (ubatches of 8 and 3), one-token
decodes, two sequences in one batch, and a 4-token draft with 2 rolled back; for the rope and MLA
hybrids also positions moved by seq_add / seq_div and decoded on (llama.cpp's K shift). A cell is
the largest max |minigraph - llama.cpp| / max |llama.cpp| over every call of those scenarios.
KV "f32": llama.cpp with an f32 K/V cache (minigraph's type); "f16": llama.cpp's default f16 cache,
so K and V are rounded there and not here. A cell that says "llama.cpp aborts" names the
assertion llama.cpp died on; timings are not measured here (the load does not matter)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, os.path.dirname(HERE))
sys.path.append(HERE)
import results  # noqa: E402  (bench/results.py)

import minigraph as mg  # noqa: E402
from minigraph.models.delta_net import DeltaNetModel  # noqa: E402
from minigraph.models.gguf_io import load_gguf, save_gguf  # noqa: E402
from minigraph.models.kda import KDAModel  # noqa: E402
from minigraph.models.lfm import LFM2Model  # noqa: E402
from minigraph.models.mamba2 import Mamba2Model  # noqa: E402
from minigraph.models.runner import Runner  # noqa: E402
from minigraph.testing import llama_calls as lc  # noqa: E402
from minigraph.testing import llama_oracle as lo  # noqa: E402

V = 48
# (arch, pattern name, layer layout shown, model maker, llama.cpp's n_rs_seq, K-shift scenarios run)
ROWS = [
    ("mamba2", "recurrent", "M M", lambda d: Mamba2Model(n_vocab=V, n_embd=64, n_layer=2, devices=d, seed=5), 0, False),
    *[("lfm2", name, " ".join("A" if x else "C" for x in hkv) + f" (kv heads {','.join(str(x) for x in hkv if x)})",
       (lambda hkv: lambda d: LFM2Model(n_vocab=V, n_embd=64, n_layer=len(hkv), n_head=4, head_count_kv=hkv,
                                        devices=d, seed=5))(hkv), 3, True)
      for name, hkv in [("default", [0, 2, 0]), ("llama.cpp-like", [0, 2, 0, 0, 2, 0]), ("attn-first", [2, 0, 0, 2]),
                        ("mqa-last", [0, 0, 1]), ("mixed-kv-heads", [4, 0, 2, 0, 1])]],
    *[("qwen35", name, " ".join("A" if (il + 1) % k == 0 else "D" for il in range(n)),
       (lambda kw: lambda d: DeltaNetModel(n_vocab=V, n_embd=64, devices=d, seed=5, **kw))(kw), 3, False)
      for name, n, k, kw in [("default", 2, 2, {}),
                             ("llama.cpp-like", 4, 4, dict(n_layer=4, full_attention_interval=4)),
                             ("every-2nd-mqa", 4, 2, dict(n_layer=4, full_attention_interval=2, n_head_kv=1)),
                             ("partial-rope", 3, 3, dict(n_layer=3, full_attention_interval=3, n_head=2, n_head_kv=2,
                                                         attn_head_dim=32, n_rot=8, rope_sections=[1, 1, 1, 1]))]],
    *[("kimi-linear", name, " ".join("M" if x else "K" for x in hkv),
       (lambda hkv, kw: lambda d: KDAModel(n_vocab=V, n_embd=64, n_layer=len(hkv), head_count_kv=hkv, devices=d,
                                           seed=5, **kw))(hkv, kw), 0, True)
      for name, hkv, kw in [("default", [0, 1], {}),
                            ("llama.cpp-like", [0, 0, 0, 1], {}),
                            ("mla-first", [1, 0, 0], dict(kv_lora_rank=16, mla_k_head_dim=40, mla_v_head_dim=24, n_rot=16)),
                            ("every-2nd", [0, 1, 0, 1], dict(kv_lora_rank=24, mla_k_head_dim=20, mla_v_head_dim=12, n_rot=4))]],
]


def worst_of(path, scenarios, kv_f32: bool, n_rs_seq: int) -> str:
    worst = 0.0
    for _, n_seq, calls in scenarios:
        r = Runner(load_gguf(path, devices=mg.backend("cpu")), mem_size=n_seq, n_rs_seq=lc.N_RS_SEQ,
                   n_ubatch=lc.N_UBATCH)
        got = lc.runner_side(r, calls)
        try:
            want = lc.llama_side(path, n_seq, calls, kv_f32=kv_f32, n_rs_seq=n_rs_seq)
        except lo.LlamaOracleError as e:
            why = str(e).split(": ")[-1]
            return f"llama.cpp aborts ({why[:60]})"
        worst = max(worst, max(e for _, _, e in lc.call_errors(got, want)))
    return f"{worst:.1e}"


def table() -> str:
    cpu = mg.backend("cpu")
    cpu.set_n_threads(1)
    lines = [f"{'arch':12s} {'pattern':15s} {'blocks':36s} {'KV':4s} {'decode scenarios':>17s} {'seq_add/div':>12s}"]
    with tempfile.TemporaryDirectory() as d:
        for arch, name, layout, make, n_rs_seq, k_shift in ROWS:
            path = save_gguf(make(cpu), os.path.join(d, f"{arch}-{name}.gguf"))
            for kv in (["f32", "f16"] if arch != "mamba2" else ["-"]):
                f32 = kv != "f16"
                main = worst_of(path, lc.SCENARIOS, f32, n_rs_seq)
                ks = worst_of(path, lc.K_SHIFT_SCENARIOS, f32, n_rs_seq) if k_shift else "-"
                lines.append(f"{arch:12s} {name:15s} {layout:36s} {kv:4s} {main:>17s} {ks:>12s}")
                print(lines[-1], flush=True)
    return "\n".join(lines)


SECTION_BEGIN, SECTION_END = results.markers("bench/llama_agreement.py --write")


def write_section(text: str, path=results.RESULTS):
    """Replace this script's section of bench/RESULTS.md, or append it."""
    results.replace_section(SECTION_BEGIN, SECTION_END, text, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="(re)write this script's section of bench/RESULTS.md")
    args = ap.parse_args(argv)
    if not lo.installed():
        print(f"bench/llama_agreement.py: {lo.not_installed_reason()}", file=sys.stderr)
        return 2
    t0 = time.time()
    body = table()
    text = ("# Agreement with llama.cpp (bench/llama_agreement.py)\n\n"
            "Max relative logits error, max |minigraph - llama.cpp| / max |llama.cpp| per call, over the "
            "scenarios named in the script's docstring (blocks: C short conv, A attention, D gated delta-net, "
            "K KDA, M MLA (kimi-linear) or Mamba-2; KV f32 = llama.cpp with an f32 K/V cache, f16 = its "
            f"default). llama-cpp-python {lo.VERSION}, 1 thread each, run in {time.time() - t0:.0f} s.\n\n"
            "```\n" + body + "\n```\n")
    print(f"# {time.time() - t0:.0f} s")
    if args.write:
        write_section(text)
        print("wrote bench/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
