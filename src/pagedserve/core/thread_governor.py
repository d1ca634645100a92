"""Adjusting the engine's compute threads to the cores other work leaves it, while it runs.

Why. torch's CPU ops and our C++ kernels split every op (several hundred per decode step) between
the threads of one OpenMP team, and an op ends when its slowest thread does. When another process
runs on one of the team's cores, the thread there gets half of that core at best, and every op
waits for it: measured on 2 cores, one busy neighbour made a W64 run 9x slower with two threads,
where one thread on the free core loses only what one core is worth (about 0.6x).

How. Twice a second the engine thread (`poll()`, before a step and after each layer: a step
slowed by a neighbour can last seconds) reads two figures:

* waiting: how long this process's threads were ready to run but had no CPU (the run delay in
  /proc/self/task/*/schedstat), less the time its cgroup's quota throttled it (cpu.stat): a quota
  stops the whole team at once and costs nothing at a barrier, a neighbour stops one thread. A
  same-priority neighbour on one of two cores makes the team wait 0.7-0.9 CPUs' worth; the
  server's own threads, mostly under a third. At WAIT_LIMIT or more, two looks in a row (or one
  look at CLEAR_WAIT), the team loses a thread.
* idle: the CPUs of the affinity mask that nobody used (/proc/stat). With a core's worth idle
  (IDLE_LIMIT) the team gets a thread back, up to its start count.

A neighbour that runs only when the CPU is otherwise idle (a nice'd batch job) leaves no idle
time behind and makes nothing wait, so it is never taken for the end of contention nor for
contention. To notice that a neighbour has left when the CPUs stay busy, the team tries one more
thread every PROBE_S seconds while below its start count, and keeps it if nothing waits; each
failed try doubles the time to the next (up to PROBE_MAX_S), so a lasting neighbour costs about
1% of throughput.

A change takes effect at the next op (torch.set_num_threads on the engine thread). The operator
can fix the count instead (PAGEDSERVE_NUM_THREADS, core/cpu_threads.py).

At one thread the kernels' helper (core/helper_thread.py) takes the half core the neighbour
leaves; it is started when the team drops to one thread and stopped before a team of more
starts. While it runs, the CPUs never idle (it spins between kernel calls), so the end of the
neighbour is read from the helper's own figures instead (neither it nor the engine thread waited
while it worked), and there is no periodic try.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from pagedserve.core.cpu_threads import ThreadPlan, allowed_cpus, cgroup_throttled_seconds
from pagedserve.core.helper_thread import HelperThread

logger = logging.getLogger(__name__)

INTERVAL_S = 0.5
"""Seconds between looks: long enough that /proc/stat's 10 ms ticks and a step's length average
out, short enough that a neighbour that comes or goes costs half a second."""
WAIT_LIMIT = 0.5
"""CPUs' worth of waiting, two looks in a row, at which the team gives up a thread. Measured on 2
cores: a busy neighbour sharing one core with a two-thread team made it wait 0.7-0.9 every look
(the spinning at each barrier keeps the thread there runnable); a server's own threads
(tritonserver's front end, the KServe event loop, a client on the same machine) mostly 0.05-0.3,
once in a while 0.57 for one look, and there a thread fewer costs a third of the throughput. A
quiet machine: under 0.1."""
CLEAR_WAIT = 0.7
"""CPUs' worth of waiting that takes a thread away at the first look: only a neighbour was seen to
cause it, and under one each look at two threads lasts a slow step (seconds on 2 cores)."""
IDLE_LIMIT = 0.7
"""CPUs' worth of idle time at which the team takes a thread back."""
PROBE_S = 30.0
PROBE_MAX_S = 300.0


COMPUTE_THREAD_NAME = "pagedserve-cpu"
"""The OS name of the engine thread when it is not the main thread, and so of the OpenMP workers
it starts (a new thread inherits its creator's name): only these threads' waiting counts. A
server's own threads in the same process (the KServe event loop, the Triton stub's response
senders) wait behind the compute threads; that is no sign of a neighbour."""


def name_compute_threads() -> bool:
    """Names the calling thread COMPUTE_THREAD_NAME; call it before the thread's first torch op,
    so that its OpenMP workers are named too. The main thread keeps its name (it is the process's
    name in ps and top): there every thread of the process counts. Returns whether it named."""
    if threading.current_thread() is threading.main_thread():
        return False
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(COMPUTE_THREAD_NAME)
    except OSError:
        return False
    return True


class Sample(NamedTuple):
    at: float
    """Clock seconds."""
    waited: float
    """Seconds the counted threads have waited for a CPU, cumulative (schedstat run delay)."""
    idle: float
    """Idle CPU-seconds of the affinity mask's CPUs, cumulative."""
    throttled: float = 0.0
    """Seconds the cgroup's quota has throttled the process, cumulative."""


def process_run_delay(task_dir: str = "/proc/self/task", name: str | None = None) -> float | None:
    """Seconds this process's live threads (those called `name`, if given) have been runnable but
    not running; None where there is no schedstat."""
    total = 0
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return None
    for tid in tasks:
        try:
            if name is not None:
                with open(f"{task_dir}/{tid}/comm") as f:
                    if f.read().strip() != name:
                        continue
            with open(f"{task_dir}/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    return total / 1e9


def idle_cpu_seconds(cpus: list[int], stat_path: str = "/proc/stat") -> float | None:
    """Idle seconds (idle + iowait) summed over `cpus` since boot; None where unreadable."""
    wanted = {f"cpu{c}" for c in cpus}
    ticks = 0
    try:
        with open(stat_path) as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] in wanted:
                    ticks += int(fields[4]) + int(fields[5])
    except (OSError, ValueError, IndexError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def read_sample(cpus: list[int], name: str | None = None) -> Sample | None:
    delay, idle = process_run_delay(name=name), idle_cpu_seconds(cpus)
    if delay is None or idle is None:
        return None
    return Sample(time.monotonic(), delay, idle, cgroup_throttled_seconds())


class ThreadGovernor:
    """The engine's compute-thread count, adjusted to the cores other work leaves (module doc)."""

    def __init__(self, plan: ThreadPlan, set_threads: Callable[[int], None], *,
                 cpus: list[int] | None = None, interval: float = INTERVAL_S,
                 sample: Callable[[list[int]], Sample | None] | None = None,
                 compute_threads_named: bool = False, helper: HelperThread | None = None) -> None:
        if sample is None:
            name = COMPUTE_THREAD_NAME if compute_threads_named else None
            sample = lambda cpus: read_sample(cpus, name)  # noqa: E731
        self.max_threads = self.threads = plan.start
        self.enabled = plan.adaptive and plan.start > 1
        self.changes = 0
        self._set_threads, self._read = set_threads, sample
        self._cpus = cpus if cpus is not None else allowed_cpus()
        self._interval = interval
        self._probe_wait = PROBE_S
        self._probing = False
        self._waited = False  # the previous look saw WAIT_LIMIT or more
        self._last = self._sample() if self.enabled else None
        self._next_probe = self._last.at + self._probe_wait if self._last else 0.0
        self._helper = helper if self.enabled else None

    def _sample(self) -> Sample | None:
        s = self._read(self._cpus)
        if s is None:
            self.enabled = False  # no schedstat or /proc/stat (not Linux, or hidden): keep the count
        return s

    def poll(self, now: float | None = None) -> None:
        """Called by the engine thread before each step and after each layer; cheap except once per
        interval."""
        if not self.enabled:
            return
        now = time.monotonic() if now is None else now
        if now - self._last.at < self._interval:
            return
        current = self._sample()
        if current is None:
            return
        wall = current.at - self._last.at
        # Throttling by the quota delays every thread of the team at once: not a neighbour's doing.
        throttled = (current.throttled - self._last.throttled) * self.threads
        waiting = (current.waited - self._last.waited - throttled) / wall
        idle = (current.idle - self._last.idle) / wall
        self._last = current
        logger.debug("compute threads %d: waiting %.2f, idle %.2f CPUs", self.threads, waiting, idle)
        waited_before, self._waited = self._waited, waiting >= WAIT_LIMIT
        # The helper's own figures say when the neighbour leaves (a try at two threads beside it would
        # cost half a second of a barrier-bound team for nothing).
        helping = self._helper is not None and self._helper.active
        if helping and self._helper.look():
            self._probe_wait = PROBE_S
            self._change(self.threads + 1, "the kernel helper's core came free")
        elif self._waited and (waited_before or self._probing or waiting >= CLEAR_WAIT) and self.threads > 1:
            if self._probing:  # the extra thread found no free core: try again later
                self._probe_wait = min(PROBE_MAX_S, 2 * self._probe_wait)
            self._change(self.threads - 1, f"threads waited {waiting:.2f} CPUs' worth for a CPU")
            self._next_probe = current.at + self._probe_wait
        elif self.threads < self.max_threads and idle >= IDLE_LIMIT:
            self._probe_wait = PROBE_S
            self._change(self.threads + 1, f"{idle:.2f} CPUs idle")
        elif self.threads < self.max_threads and current.at >= self._next_probe and not helping:
            self._change(self.threads + 1, "trying whether a core came free")
            self._probing = True
            return
        elif self._probing:
            self._probe_wait = PROBE_S  # the try succeeded
        self._probing = False

    def _change(self, threads: int, why: str) -> None:
        logger.info("compute threads %d -> %d: %s over the last %.1f s", self.threads, threads, why, self._interval)
        # One thread beside a busy core: the kernels share with the helper. It stops (and the engine
        # thread is unpinned) before a team of more starts: new OpenMP workers inherit the pin.
        if self._helper is not None and threads > 1:
            self._helper.stop()
        self._set_threads(threads)
        self.threads = threads
        self.changes += 1
        if self._helper is not None and threads == 1:
            self._helper.start()
