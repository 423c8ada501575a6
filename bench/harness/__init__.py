"""The runner's side of the benchmarks (main virtual environment only)."""
