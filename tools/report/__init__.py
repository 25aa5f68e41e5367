"""The report: the README's results table and chart, and the documentation's benchmarks page with its charts, all
made from ``benchmarks/results/*.json``, so a published number changes in one place, its results file.

Run from the repository root (it needs only the standard library):

    python -m tools.report --write           # README table (between its markers), docs/benchmarks.md, charts
    python -m tools.report --check           # exit 1 if any of those is out of date (the docs build runs it)
    python -m tools.report --table           # the README's table on stdout
    python -m tools.report                   # the whole benchmarks page (Markdown) on stdout
    python -m tools.report --out page.md --charts charts/   # page to a file, its SVG charts beside it

``tools.report.data`` reads the results files, ``tools.report.sections`` writes the page's per-benchmark sections
and ``tools.report.generate`` the rest.
"""

from tools.report.generate import generated
from tools.report.generate import load_results
from tools.report.generate import main
from tools.report.generate import page


__all__ = ["generated", "load_results", "main", "page"]
