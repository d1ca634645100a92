"""Test and benchmark harness: starting real servers on loopback (not part of the package).

Tests and benchmarks alike import it as `tests.harness`, with the checkout root on the path (pytest's
`pythonpath` in pyproject.toml; `python -m bench.X` run from the root).
"""

# One intra-op thread for the servers the tests start: with 2 cores shared by the test process and
# other servers, a second thread makes small torch ops far slower (see tests/conftest.py).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
