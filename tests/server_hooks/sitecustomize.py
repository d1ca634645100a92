"""Imported at start-up by Python processes that have this directory on PYTHONPATH (the kserve
servers of the reliability and OpenAI tests): installs pagedserve_test_hooks from environment
variables, PAGEDSERVE_TEST_STEP_DELAY (seconds), PAGEDSERVE_TEST_FAULT_FILE,
PAGEDSERVE_TEST_BATCH_LOG and PAGEDSERVE_TEST_PACE_FILE (paths)."""

import os

_PATHS = ("PAGEDSERVE_TEST_FAULT_FILE", "PAGEDSERVE_TEST_BATCH_LOG", "PAGEDSERVE_TEST_PACE_FILE")

if os.environ.get("PAGEDSERVE_TEST_STEP_DELAY") or any(os.environ.get(name) for name in _PATHS):
    import pagedserve_test_hooks

    pagedserve_test_hooks.install(float(os.environ.get("PAGEDSERVE_TEST_STEP_DELAY") or 0),
                                  *(os.environ.get(name) or None for name in _PATHS))
