"""The C++ kernels' helper thread beside a one-thread team, and which core each thread runs on.

Why. Beside a busy neighbour core the thread governor (core/thread_governor.py) computes with one
thread: a barrier-synchronized team waits at every op for the thread the neighbour shares a core
with. One thread leaves unused the half core the neighbour does not take. The C++ linear and
decode-attention kernels can share a call with a helper thread that claims chunks of the output
and is never waited for (kernels/cpu/work_share.h), so the helper turns that half core into
throughput.

Where. The engine thread runs alone on one core (its Python work between ops, torch's own ops
and its share of the kernels go at full speed) and the helper on another, beside the neighbour.
The pair starts on the engine thread's current core; if the engine thread then waits for its CPU
while the helper does not, the neighbour is on the engine's core and the two swap. When neither
waits while the helper works, the neighbour has left: `look` says so and the governor takes its
second OpenMP thread back (which turns the helper off and unpins both).
"""

from __future__ import annotations

import logging
import os
import threading
import time

logger = logging.getLogger(__name__)

SWAP_WAIT = 0.25
"""Share of the interval the engine thread waited for its CPU, with the helper waiting less by
SWAP_MARGIN, at which the two change cores: a neighbour sharing the engine's core makes it wait
about half the time."""
SWAP_MARGIN = 0.2
FREE_WAIT = 0.05
"""Both threads waited under this share of the interval while the helper worked (ran at least
FREE_RUN of it): no neighbour on either core."""
FREE_RUN = 0.2


def thread_cpu_times(tid: int | None = None) -> tuple[float, float] | None:
    """(seconds run, seconds waited for a CPU) of one thread of this process (None: the calling
    thread), from its schedstat; None where there is none."""
    path = "/proc/thread-self/schedstat" if tid is None else f"/proc/self/task/{tid}/schedstat"
    try:
        with open(path) as f:
            run, wait = f.read().split()[:2]
        return int(run) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return None


def current_cpu() -> int | None:
    """The CPU the calling thread last ran on."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


class HelperThread:
    """The kernels' helper for the engine thread: `start` and `look` on the engine thread, `stop` on any."""

    def __init__(self, kernels, cpus: list[int]) -> None:
        self._kernels, self._cpus = kernels, cpus
        self.active = False
        self.swaps = 0
        self._engine_cpu = self._helper_cpu = -1
        self._tid = self._engine_tid = 0
        self._last: tuple[float, tuple[float, float], tuple[float, float]] | None = None

    @classmethod
    def for_this_process(cls, cpus: list[int]) -> HelperThread | None:
        """None where the kernels cannot share (no C++ extension, one CPU, no schedstat)."""
        if len(cpus) < 2 or thread_cpu_times() is None or current_cpu() is None:
            return None
        if os.environ.get("PAGEDSERVE_KERNEL_HELPER", "1").strip() in ("0", "false", "off", "no"):
            return None
        try:
            from pagedserve.kernels.cpu.build import CpuKernelsUnavailable, load_extension
            kernels = load_extension()
        except (ImportError, CpuKernelsUnavailable):
            return None
        return cls(kernels, cpus) if hasattr(kernels, "work_share_set_helper") else None

    def start(self) -> None:
        self._engine_tid = threading.get_native_id()
        engine = current_cpu()
        if engine not in self._cpus:
            engine = self._cpus[0]
        self._pin(engine, next(c for c in self._cpus if c != engine))
        self.active = True
        logger.info("kernel helper thread on CPU %d beside the engine thread on CPU %d", self._helper_cpu, engine)

    def stop(self) -> None:
        """Also called when the engine is collected (LLMEngine), on whatever thread that happens:
        the engine thread is unpinned by its id."""
        if not self.active:
            return
        self._kernels.work_share_set_helper(False, -1)
        try:
            os.sched_setaffinity(self._engine_tid, self._cpus)
        except OSError:
            pass  # the engine thread has ended
        self.active, self._last = False, None

    def _pin(self, engine_cpu: int, helper_cpu: int) -> None:
        self._engine_cpu, self._helper_cpu = engine_cpu, helper_cpu
        os.sched_setaffinity(self._engine_tid, {engine_cpu})  # a thread id: that thread alone
        self._tid = self._kernels.work_share_set_helper(True, helper_cpu)
        self._last = None

    def look(self) -> bool:
        """Called by the governor at each of its looks while active: swaps the two threads' cores if
        the engine's is the busy one; returns whether no core is shared any more."""
        now, engine, helper = time.monotonic(), thread_cpu_times(), thread_cpu_times(self._tid)
        if engine is None or helper is None:
            return False
        last, self._last = self._last, (now, engine, helper)
        if last is None:
            return False
        wall = now - last[0]
        engine_wait = (engine[1] - last[1][1]) / wall
        helper_run, helper_wait = (helper[0] - last[2][0]) / wall, (helper[1] - last[2][1]) / wall
        logger.debug("kernel helper: engine waited %.2f, helper ran %.2f and waited %.2f", engine_wait, helper_run,
                     helper_wait)
        if engine_wait >= SWAP_WAIT and engine_wait >= helper_wait + SWAP_MARGIN:
            logger.info("kernel helper: the engine thread waited %.2f of its CPU %d, the helper %.2f: swapping cores",
                        engine_wait, self._engine_cpu, helper_wait)
            self._pin(self._helper_cpu, self._engine_cpu)
            self.swaps += 1
            return False
        return helper_run >= FREE_RUN and engine_wait < FREE_WAIT and helper_wait < FREE_WAIT
