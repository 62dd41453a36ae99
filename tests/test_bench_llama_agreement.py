"""bench/llama_agreement.py's report plumbing (no llama.cpp needed): its rows name the four
architectures with attention blocks where llama.cpp needs them, and --write replaces only its own
section of RESULTS.md."""
import importlib.util
import os

import minigraph as mg

HERE = os.path.dirname(os.path.abspath(__file__))


def _script():
    path = os.path.join(HERE, "..", "bench", "llama_agreement.py")
    spec = importlib.util.spec_from_file_location("llama_agreement", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_cover_the_four_archs_and_each_hybrid_has_attention():
    mod = _script()
    assert {r[0] for r in mod.ROWS} == {"mamba2", "lfm2", "qwen35", "kimi-linear"}
    for arch, name, _, make, _, _ in mod.ROWS:
        m = make(mg.backend("ref"))
        assert m.arch == arch
        assert arch == "mamba2" or getattr(m, "attn_layers", ()), (arch, name)


def test_write_replaces_only_its_own_section(tmp_path):
    mod = _script()
    p = tmp_path / "RESULTS.md"
    p.write_text("# Other\nkeep me\n")
    mod.write_section("# Agreement\nfirst\n", p)
    mod.write_section("# Agreement\nsecond\n", p)
    doc = p.read_text()
    assert doc.startswith("# Other\nkeep me\n") and "second" in doc and "first" not in doc
    assert doc.count(mod.SECTION_BEGIN) == 1 and doc.rstrip().endswith(mod.SECTION_END)
