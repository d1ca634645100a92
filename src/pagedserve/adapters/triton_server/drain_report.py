"""The models' word back to `pagedserve triton` that their drain is over, so that it can end
tritonserver at once instead of waiting out Triton's own shutdown.

Why. Once every request has its final response and the engine is shut down, nothing a client needs
is left in the server, yet tritonserver 2.51 still takes 2-3 s to exit after SIGTERM or SIGINT:
its Python backend sleeps 1 s (a stub health check, StubLauncher::UpdateHealth) before it calls
finalize(), TRITONSERVER_ServerStop looks for the unloaded model once a second, and stopping the
endpoints and the teardown take 0.3-1 s more. None of it can be set (`tritonserver --help` offers
only --exit-timeout-secs, and 0 there makes it exit 1 before the models have unloaded).

How. Each stub (one model instance, one engine) whose model saw the launcher's shutdown notice
writes `drained-<its pid>` beside the notice once its drain is complete: the engine is shut down,
every request it was handed has its final response (data or error) accepted by tritonserver, and
none is pending. The file holds time.monotonic() (one clock for every process of the machine) of
the last response the stub sent. The launcher ends tritonserver's session when every Python stub
tritonserver runs has written its file and FLUSH_GRACE_S has passed since the latest of those
responses: a response the stub handed over is in tritonserver's frontend, which writes it to the
client's socket within milliseconds, and once in the socket the kernel delivers it even after the
process is gone. A stub of some other Python model never writes the file, and the launcher then
waits for tritonserver as before.
"""

from __future__ import annotations

import os
from pathlib import Path

MARKER_PREFIX = "drained-"
STUB_EXECUTABLE = "triton_python_backend_stub"
"""The Python backend's process, which runs this model (and nothing else does)."""
FLUSH_GRACE_S = 0.3
"""How long after a stub's last response the launcher waits before ending tritonserver: time for
the frontend's thread to write that response to the client's socket (milliseconds when the
machine is idle; the margin is for a loaded one)."""


def marker_path(notice: str | Path, pid: int) -> Path:
    return Path(notice).parent / f"{MARKER_PREFIX}{pid}"


def report_drained(notice: str | Path, last_response_at: float) -> Path:
    """Write this process's marker (atomically: the launcher never reads half a file)."""
    path = marker_path(notice, os.getpid())
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{last_response_at:.6f}\n")
    os.replace(tmp, path)
    return path


def stub_pids(server_pid: int) -> set[int] | None:
    """The Python backend stubs tritonserver `server_pid` runs (its children running the stub);
    None where /proc cannot tell."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    stubs = set()
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != server_pid or fields[0] == "Z":
                continue
            if os.path.basename(os.readlink(f"/proc/{name}/exe")) == STUB_EXECUTABLE:
                stubs.add(int(name))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return stubs


def drained_since(notice: str | Path, server_pid: int) -> float | None:
    """time.monotonic() of the last response of any stub once every stub of tritonserver
    `server_pid` has reported its drain complete; None while one has not (or none runs, or /proc
    cannot tell)."""
    stubs = stub_pids(server_pid)
    if not stubs:
        return None
    latest = 0.0
    for pid in stubs:
        try:
            latest = max(latest, float(marker_path(notice, pid).read_text()))
        except (OSError, ValueError):
            return None
    return latest
