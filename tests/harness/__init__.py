"""Test and benchmark harness: starting real servers on loopback (not part of the package).

Tests import it as `harness` (tests/conftest.py puts tests/ on sys.path); the benchmarks, run from
the checkout root, as `tests.harness`. The modules import each other relatively, so both work.
"""
