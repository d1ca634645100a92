"""A process and all its descendants, from /proc (Linux): who they are and their resident memory.

The launchers start process trees (pagedserve -> tritonserver -> one Python backend stub per model
instance; the kserve server), so their footprint is the sum over the tree.
"""

from __future__ import annotations

import os

from pagedserve.adapters.child_process import stat_fields


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = stat_fields(entry) if entry.isdigit() else None
        if fields is not None:  # None: exited meanwhile
            kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def _status(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except OSError:
        return None


def process_tree(root: int) -> list[tuple[int, str]]:
    """(pid, name) of `root` and every live descendant; names are the kernel's (15 characters)."""
    kids, todo, out = _children(), [root], []
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, ()))
        status = _status(pid)
        if status is not None:
            out.append((pid, status.get("Name", "?")))
    return out


def tree_rss(root: int) -> tuple[int, dict[str, int]]:
    """(total RSS bytes, {process name: RSS bytes}) of `root` and its descendants. Pages shared
    between processes count once per process, as `ps` and the OOM killer count them."""
    total, parts = 0, {}
    for pid, name in process_tree(root):
        status = _status(pid)
        if status is None:
            continue
        rss = int(status.get("VmRSS", "0 kB").split()[0]) * 1024
        total += rss
        parts[name] = parts.get(name, 0) + rss
    return total, parts


def tree_cpu_seconds(root: int) -> float:
    """CPU time (user + system) used so far by `root` and its live descendants, including the
    children they have already waited for. On a busy machine this, unlike wall time, does not
    grow with what other processes run."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid, _name in process_tree(root):
        fields = stat_fields(pid)
        if fields is None:
            continue
        total += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    return total / ticks


def memory_breakdown(pid: int) -> dict[str, int]:
    """Resident bytes of one process by kind of mapping, from /proc/PID/smaps; empty if the process
    is gone. In a pagedserve engine the KV pool is one private mapping per layer tensor, allocated
    one after the other, which the kernel usually merges into one mapping of the pool's size (with
    any neighbour of the same kind): then it is the "anon >= 1 GiB" part. Another thread's mapping
    landing between two of them splits it, and the smaller pieces count as "other anon"."""
    parts: dict[str, int] = {}
    kind = "other"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(None, 5)
                if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
                    start, end = (int(x, 16) for x in head[0].split("-"))
                    name = head[5].strip() if len(head) > 5 else ""
                    if name.startswith("/") and "(deleted)" not in name and not name.startswith("/dev/shm"):
                        kind = "files (libraries)"
                    elif name.startswith("/dev/shm") or name.startswith("/memfd"):
                        kind = "shared memory"
                    elif name == "[heap]":
                        kind = "heap (main malloc arena)"
                    elif not name and end - start >= 1 << 30:
                        kind = "anon >= 1 GiB"
                    else:
                        kind = "other anon"
                elif head[0] == "Rss:":
                    parts[kind] = parts.get(kind, 0) + int(head[1]) * 1024
    except OSError:
        return {}
    return parts
