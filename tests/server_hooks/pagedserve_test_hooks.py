"""Test-only hooks in the engine's step, for servers the reliability tests start (the servers
import this module: Triton through the test repository's model.py, kserve through the
sitecustomize.py beside it). Product code knows nothing of them.

* delay: each engine step with work takes at least this long (seconds), so how long a request
  runs does not depend on machine speed;
* fault_file: while this file exists, the next forward pass deletes it and raises, as a failing
  kernel would (one fault per file the test writes).

SIGUSR1 makes a server process print every thread's stack (faulthandler): how to see where a
hung test server waits. A crash (SIGSEGV, SIGABRT, ...) prints "Fatal Python error" and the
stacks to the server's log: a Triton stub that crashes on its way out does so silently otherwise.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time


def install(delay: float = 0.0, fault_file: str | None = None) -> None:
    from pagedserve.core import model_runner

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.enable(all_threads=True)

    real_execute = model_runner.ModelRunner.execute

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
        return real_execute(self, out, *args, **kwargs)

    model_runner.ModelRunner.execute = execute
