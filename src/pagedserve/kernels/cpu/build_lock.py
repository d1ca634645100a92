"""One build of the CPU kernels at a time per build directory, and no build left waiting forever on
a lock that a killed build left behind.

torch.utils.cpp_extension serialises builds with a lock *file* (``<build dir>/lock``, created with
O_EXCL and deleted when the build ends). A build that is killed (Ctrl-C at the wrong moment, a test
timeout, the OOM killer) leaves the file behind, and every later ``cpp_extension.load`` of that
build then sleeps forever, silently. So the build first takes its own lock, an ``flock`` that the
kernel drops whenever its holder dies, and under it deals with torch's file:

* nobody has it open (torch keeps the file open for the whole build): left by a dead build, so it
  is removed with a warning;
* where open files cannot be listed (no /proc), it is removed once it is older than any build
  takes (``STALE_AFTER_S``);
* otherwise a build outside this lock is running right now, and torch waits for it as usual.

Only the standard library: ``kernels/cpu/build.py`` imports this without importing torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("pagedserve.kernels.cpu")

LOCK = "pagedserve-build.lock"
"""Our flock file in the build directory (never deleted: the lock is the flock, not the file)."""
TORCH_LOCK = "lock"
"""torch.utils.file_baton.FileBaton's file in the build directory."""
STALE_AFTER_S = 30 * 60.0
"""Where holders cannot be listed: a torch lock this old is stale (a build takes about a minute)."""


def _holders(path: Path) -> list[int] | None:
    """Processes that have `path` open, from /proc; None where that cannot be told."""
    if not Path("/proc/self/fd").is_dir():
        return None
    target, pids = os.path.realpath(path), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fds = list(os.scandir(f"{entry.path}/fd"))
        except OSError:
            continue  # exited meanwhile, or another user's process
        for fd in fds:
            try:
                if os.readlink(fd.path) == target:
                    pids.append(int(entry.name))
                    break
            except OSError:
                continue
    return pids


def clear_stale_torch_lock(build_dir: Path) -> bool:
    """Remove torch's lock file in `build_dir` when the build that made it is gone; returns whether
    it did. Call only while holding `exclusive_build(build_dir)`."""
    lock = build_dir / TORCH_LOCK
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    holders = _holders(lock)
    if holders:
        logger.warning("waiting for process %s, which is building the CPU kernels in %s outside pagedserve's "
                       "build lock", ", ".join(map(str, holders)), build_dir)
        return False
    if holders is None and age < STALE_AFTER_S:
        return False
    why = "nobody holds it" if holders is not None else f"it is {age / 60:.0f} minutes old"
    logger.warning("removing %s, left by a build of the CPU kernels that was killed (%s); building again",
                   lock, why)
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
    return True


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold the build directory's flock (waiting, with a message, while another process builds),
    with torch's lock file cleared if a killed build left it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("another process is building the CPU kernels in %s; waiting for it", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            clear_stale_torch_lock(build_dir)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
