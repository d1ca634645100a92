"""The test suite, a package so its helpers have one import name each (`tests.oracle`,
`tests.harness.local_ports`), the same in tests and in benchmarks. pyproject.toml's pytest
`pythonpath` puts the checkout root on the path; nothing here edits sys.path."""
