"""Test tooling shared by the test suite, `minigraph check` and the benchmarks: the op case
table and real ggml as an oracle. Nothing in the core imports it."""
