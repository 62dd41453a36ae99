"""bench/llama_agreement.py's report plumbing (no llama.cpp needed): its rows name the four
architectures with attention blocks where llama.cpp needs them, and --write replaces only its own
section of RESULTS.md."""

import minigraph as mg

import bench_scripts


def _script():
    return bench_scripts.load("llama_agreement")


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
