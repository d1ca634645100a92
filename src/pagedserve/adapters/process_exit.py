"""Ending a server process once its work is done, without the interpreter's teardown."""

from __future__ import annotations

import logging
import os
import sys


def exit_without_teardown(code: int) -> None:
    """Flush logging, stdout and stderr, then end the process with `code` at once. Freeing torch,
    transformers and the engine's objects one by one returns nothing to the system that the exit
    does not, and took seconds of a stop (callers say how much). Exit handlers are skipped;
    logging's is the one that matters, and it runs here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream has nothing to flush
            pass
    os._exit(code)
