"""Kernel tests: every kernel against its pure-torch twin (tests/kernels/conftest.py sets the interpreter up)."""
