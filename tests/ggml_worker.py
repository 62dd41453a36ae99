"""Runs in a process of its own for the ggml backend's tests: it loads llama.cpp's ggml (0.25),
which must not share a process with the op oracle's libggml-python (0.20) that the test process
loads. Nothing here loads libggml-python.

    python tests/ggml_worker.py logits MODEL OUT.npz SPEC [SPEC ...]
        decode the same scenario (two sequences, a prompt, speculative steps with rollbacks) on
        each device list SPEC; OUT.npz gets the logits of each (key = SPEC) and, per SPEC, the
        runner's graph builds and reuses and the ggml graphs built
    python tests/ggml_worker.py kill MODEL SPEC
        decode a prompt, print READY, wait for a line on stdin (the test kills a server then),
        try one more step and print ERROR <the one-line message> and STATE SAME or STATE CHANGED
        (the memory of the devices that are not RPC devices, before and after the failed step)"""
from __future__ import annotations

import sys

import numpy as np

from minigraph.models.runner import Runner
from minigraph.models.zoo import make_model, parse_devices

N_LAYER = 4
PROMPT = {0: [3, 1, 4, 1, 5, 9, 2, 6], 1: [2, 7, 1, 8, 2]}
STEPS = [(0, [5, 3, 5, 8], 2), (1, [9, 7, 9], 1), (0, [3, 2, 3, 8], 4), (0, [4, 6, 2, 6], 1), (1, [4, 3], 2)]


def scenario(name: str, spec: str):
    devices = parse_devices(spec)
    model = make_model(name, devices, seed=0, n_layer=N_LAYER)
    runner = Runner(model, mem_size=2, n_rs_seq=3)
    out = [runner.decode_seq_tokens(PROMPT)[s] for s in sorted(PROMPT)]
    for seq, draft, n_accept in STEPS:
        out.append(runner.speculative_step(seq, draft, n_accept))
    built = sum(getattr(d, "graphs_built", 0) for d in devices)
    return np.concatenate(out), np.array([runner.stats.builds, runner.stats.reuses, built])


def client_state(runner) -> list:
    return [t.numpy() for t in runner.memory.tensors() if not t.backend.name.startswith("ggml:rpc")]


def main(argv) -> int:
    mode, name = argv[0], argv[1]
    if mode == "logits":
        out = {}
        for spec in argv[3:]:
            logits, stats = scenario(name, spec)
            out[spec], out[spec + "#stats"] = logits, stats
        np.savez(argv[2], **out)
        return 0
    if mode == "kill":
        devices = parse_devices(argv[2])
        runner = Runner(make_model(name, devices, seed=0, n_layer=N_LAYER), mem_size=2, n_rs_seq=3)
        runner.decode_seq_tokens(PROMPT)
        before = client_state(runner)
        print("READY", flush=True)
        sys.stdin.readline()
        try:
            runner.speculative_step(0, [5, 3, 5, 8], 2)
            print("ERROR none", flush=True)
        except Exception as e:
            print(f"ERROR {type(e).__name__}: {e}", flush=True)
        after = client_state(runner)
        same = all(np.array_equal(a, b) for a, b in zip(before, after))
        print("STATE SAME" if same else "STATE CHANGED", flush=True)
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
