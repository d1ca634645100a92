"""Test-only hooks in the engine's step, for servers the reliability tests start (the servers
import this module: Triton through the test repository's model.py, kserve through the
sitecustomize.py beside it). Product code knows nothing of them.

* delay: each engine step with work takes at least this long (seconds), so how long a request
  runs does not depend on machine speed;
* fault_file: while this file exists, the next forward pass deletes it and raises, as a failing
  kernel would (one fault per file the test writes);
* batch_log: each forward pass that samples appends a line to this file: how many samples got a
  token from it, so a test sees what the engine batched without judging it by the clock;
* pace_file: while this file exists, each forward pass with work first waits the seconds it holds
  (a test slows the steps of a running server for as long as it needs, then lets it run free).

SIGUSR1 makes a server process print every thread's stack (faulthandler): how to see where a
hung test server waits. A crash (SIGSEGV, SIGABRT, ...) prints "Fatal Python error" and the
stacks to the server's log: a Triton stub that crashes on its way out does so silently otherwise.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time


def install(delay: float = 0.0, fault_file: str | None = None, batch_log: str | None = None,
            pace_file: str | None = None) -> None:
    from pagedserve.core import model_runner

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.enable(all_threads=True)

    real_execute = model_runner.ModelRunner.execute
    log = open(batch_log, "a", buffering=1) if batch_log else None  # noqa: SIM115 - for the process's life

    def execute(self, out, *args, **kwargs):
        if fault_file and not out.is_empty and os.path.exists(fault_file):
            try:
                os.unlink(fault_file)
            except FileNotFoundError:
                pass
            else:
                raise RuntimeError("injected fault: the forward pass raised")
        if delay and not out.is_empty:
            time.sleep(delay)
        if pace_file and not out.is_empty:
            time.sleep(_seconds_in(pace_file))
        result = real_execute(self, out, *args, **kwargs)
        if log is not None and result.sampled:  # written before the tokens go out to any client
            log.write(f"{len(result.sampled)}\n")
        return result

    model_runner.ModelRunner.execute = execute


def _seconds_in(path: str) -> float:
    try:
        with open(path) as f:
            return float(f.read())
    except (FileNotFoundError, ValueError):
        return 0.0
