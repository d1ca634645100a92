"""Busy neighbour processes for the shared-CPU benchmarks (`--noisy-neighbour N`).

A Kubernetes node or a Triton host is never idle: other pods, the server's own front end and the
hypervisor take CPU time from the engine. The benchmarks imitate the simplest such neighbour: N
processes that spin (`while True: pass`), each pinned to one of the last N CPUs this process may
use, the way `taskset -c 1 python -c "while True: pass"` does by hand. They run at the same
priority as the benchmark, so the kernel shares those cores evenly between them and the engine.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

SPIN = "while True: pass"


@contextlib.contextmanager
def busy_neighbours(count: int) -> Iterator[list[int]]:
    """Runs `count` spinning processes, one pinned to each of the last `count` usable CPUs, for the
    duration of the block; yields those CPUs. count 0 runs none."""
    cpus = sorted(os.sched_getaffinity(0))
    if count < 0 or count > len(cpus):
        raise ValueError(f"--noisy-neighbour {count}: this process may use {len(cpus)} CPUs; choose 0..{len(cpus)}")
    pinned = cpus[len(cpus) - count:] if count else []
    procs = [subprocess.Popen([sys.executable, "-c", SPIN], preexec_fn=lambda cpu=cpu: os.sched_setaffinity(0, {cpu}))
             for cpu in pinned]
    try:
        yield pinned
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def add_neighbour_arg(ap) -> None:
    ap.add_argument("--noisy-neighbour", type=int, default=0, metavar="N",
                    help="after the quiet run, run again with N busy processes pinned to the last N CPUs "
                         "and print the ratio of the two (see bench/neighbours.py)")
