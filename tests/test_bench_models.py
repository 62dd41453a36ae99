"""bench/models.py and bench/ggml_models.py time endless decodes of the zoo's models made recurrent
only (zoo.recurrent_only): each must come out without attention blocks (a KV cache would fill after
a few hundred steps and stop the benchmark, as it did once the zoo's delta-net and kda gained
attention blocks)."""
from __future__ import annotations

import pytest

import minigraph as mg
from minigraph.models.memory import RecurrentMemory
from minigraph.models.runner import Runner
from minigraph.models.zoo import make_model, recurrent_only

import bench_scripts


@pytest.mark.parametrize("script", ["models", "ggml_models"])
def test_benchmarked_models_are_recurrent_only(script):
    mod = bench_scripts.load(script)
    for name in mod.MODELS:
        model = make_model(name, [mg.backend("cpu")], n_layer=mod.N_LAYER, **recurrent_only(name, mod.N_LAYER))
        memory = Runner(model, mem_size=4, n_rs_seq=3, n_ubatch=64, atomic=False).memory
        assert isinstance(memory, RecurrentMemory), f"{script}: {name} has attention blocks ({type(memory).__name__})"
