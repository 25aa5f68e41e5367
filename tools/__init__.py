"""Tools for working on this repository (not part of any package): ``python -m tools.report`` makes the published
benchmark tables from ``benchmarks/results/``."""
