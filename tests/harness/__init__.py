"""Test and benchmark harness: starting real servers on loopback (not part of the package).

Tests and benchmarks alike import it as `tests.harness`, with the checkout root on the path (pytest's
`pythonpath` in pyproject.toml; `python -m bench.X` run from the root).
"""
