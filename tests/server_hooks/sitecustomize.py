"""Imported at start-up by Python processes that have this directory on PYTHONPATH (the kserve
servers of the reliability tests): installs pagedserve_test_hooks from two environment variables,
PAGEDSERVE_TEST_STEP_DELAY (seconds) and PAGEDSERVE_TEST_FAULT_FILE (a path)."""

import os

if os.environ.get("PAGEDSERVE_TEST_STEP_DELAY") or os.environ.get("PAGEDSERVE_TEST_FAULT_FILE"):
    import pagedserve_test_hooks

    pagedserve_test_hooks.install(float(os.environ.get("PAGEDSERVE_TEST_STEP_DELAY") or 0),
                                  os.environ.get("PAGEDSERVE_TEST_FAULT_FILE") or None)
