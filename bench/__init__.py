"""Benchmarks, each against a peer in the same run. Run them from the checkout root as modules,
`python -m bench.throughput` (docs/benchmarks.md): `-m` puts the checkout root on the path, so
`bench` and the test harness (`tests.harness`) import by name, and pagedserve comes from the install."""
