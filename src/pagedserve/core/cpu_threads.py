"""How many threads the engine computes with on a CPU at start (core/thread_governor.py adjusts
the count while it runs).

torch's CPU ops and our C++ kernels split every op between the threads of one OpenMP team. By
default OpenMP makes the team as large as the affinity mask, which ignores a container's CPU
quota: a pod limited to 1.5 CPUs on a 64-core node would compute with 64 threads. The engine
starts instead with the threads the process may actually use: the CPUs in its affinity mask
(`taskset`, a Kubernetes CPU-manager pinning), capped by its cgroup's CPU quota (`cpu.max` on
cgroup v2, `cpu.cfs_quota_us` on v1, the tightest of its cgroup and their ancestors). Half a CPU of
quota counts as a thread: a 1.5-CPU limit gives 2 threads, since a quota throttles the whole team
at once, which costs no waiting at a barrier, so 1.5 CPUs of two threads beat one.

The operator decides instead with PAGEDSERVE_NUM_THREADS=N (or OMP_NUM_THREADS=N): the engine then
computes with N threads from start to end. PAGEDSERVE_THREAD_GOVERNOR=0 keeps the start count but
stops the adjusting. Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

def _env_count(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a thread count; set a whole number >= 1 or unset it") from None
    if count < 1:
        raise ValueError(f"{name}={value!r}: the thread count must be at least 1")
    return count


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask), in order."""
    return sorted(os.sched_getaffinity(0))


def _cgroup_dirs(proc_cgroup: str, root: Path) -> list[tuple[str, Path]]:
    """(version, directory) of this process's cgroup for the cpu controller, v2 and/or v1."""
    found = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            found.append(("v2", root / path.lstrip("/")))
        elif "cpu" in controllers.split(","):
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                if (root / mount).is_dir():
                    found.append(("v1", root / mount / path.lstrip("/")))
                    break
    return found


def _quota_at(version: str, directory: Path) -> float | None:
    try:
        if version == "v2":
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())
        period_us = int((directory / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def _cgroup_chain(proc_cgroup_path: str, root: Path) -> list[tuple[str, Path]]:
    """(version, directory) of this process's cpu cgroup and each of its ancestors: a limit on
    any of them bounds this process too."""
    try:
        text = Path(proc_cgroup_path).read_text()
    except OSError:
        return []
    chain = []
    for version, directory in _cgroup_dirs(text, root):
        d = directory
        while True:
            chain.append((version, d))
            if d == root or root not in d.parents:
                break
            d = d.parent
    return chain


def cgroup_cpu_quota(proc_cgroup_path: str = "/proc/self/cgroup", root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota in CPUs (1.5 = 150 ms per 100 ms) of this process's cgroup or the tightest of
    its ancestors, v2 or v1; None where there is none (or no cgroup file system to read)."""
    quotas = [q for version, d in _cgroup_chain(proc_cgroup_path, root) if (q := _quota_at(version, d)) is not None]
    return min(quotas) if quotas else None


def cgroup_throttled_seconds(proc_cgroup_path: str = "/proc/self/cgroup", root: Path = Path("/sys/fs/cgroup")) -> float:
    """Seconds this process's cgroup (or the most throttled ancestor) has spent throttled by its CPU
    quota since it was made: `throttled_usec` (v2) or `throttled_time` (v1, ns) in cpu.stat."""
    most = 0.0
    for version, d in _cgroup_chain(proc_cgroup_path, root):
        key, unit = ("throttled_usec", 1e-6) if version == "v2" else ("throttled_time", 1e-9)
        try:
            for line in (d / "cpu.stat").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    most = max(most, int(value) * unit)
        except (OSError, ValueError):
            continue
    return most


def threads_for(cpus: int, quota: float | None) -> int:
    """Threads for `cpus` usable CPUs under `quota` CPUs: half a CPU of quota counts as one."""
    if quota is None:
        return max(1, cpus)
    return max(1, min(cpus, math.floor(quota + 0.5)))


@dataclass(frozen=True)
class ThreadPlan:
    start: int
    """Threads the engine starts with."""
    adaptive: bool
    """Whether the governor may lower (and raise back to `start`) the count while it runs."""
    why: str


def thread_plan() -> ThreadPlan:
    """What the environment and the machine say: an operator's count wins and is kept."""
    for name in ("PAGEDSERVE_NUM_THREADS", "OMP_NUM_THREADS"):
        count = _env_count(name)
        if count is not None:
            return ThreadPlan(count, False, f"{name}={count}")
    cpus, quota = allowed_cpus(), cgroup_cpu_quota()
    start = threads_for(len(cpus), quota)
    adaptive = os.environ.get("PAGEDSERVE_THREAD_GOVERNOR", "1").strip() not in ("0", "false", "off", "no")
    why = f"{len(cpus)} CPUs in the affinity mask" + (f", cgroup quota {quota:g} CPUs" if quota else "")
    return ThreadPlan(start, adaptive, why)
