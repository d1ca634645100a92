"""Helpers for the reliability tests on real servers: the step hooks of tests/server_hooks
(slow steps, injected faults, a log of batch sizes, paced steps), the largest gap between a stream's deltas,
and log checks."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

HOOKS_DIR = Path(__file__).parent / "server_hooks"
MARKER = "zebra-quokka-7319"
"""In every prompt the reliability tests send: the server logs must never contain it."""


def kserve_hooks_env(delay: float = 0.0, fault_file: Path | None = None, batch_log: Path | None = None,
                     pace_file: Path | None = None) -> dict[str, str]:
    """Environment for a kserve server process that loads the hooks (sitecustomize.py)."""
    path = os.pathsep.join(p for p in (str(HOOKS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "PAGEDSERVE_TEST_STEP_DELAY": str(delay)}
    for name, value in (("FAULT_FILE", fault_file), ("BATCH_LOG", batch_log), ("PACE_FILE", pace_file)):
        if value is not None:
            env[f"PAGEDSERVE_TEST_{name}"] = str(value)
    return env


def install_triton_hooks(model_dir: Path, delay: float, fault_file: Path | None,
                         batch_log: Path | None = None, pace_file: Path | None = None) -> None:
    """Make a test repository's model.py install the hooks before it loads the adapter (the Python
    backend stub does not take PYTHONPATH from the server's environment, so the hooks module is
    loaded from its file)."""
    model_py = model_dir / "1" / "model.py"
    hooks = HOOKS_DIR / "pagedserve_test_hooks.py"
    paths = [str(p) if p is not None else None for p in (fault_file, batch_log, pace_file)]
    model_py.write_text(
        "import importlib.util\n"
        f"_spec = importlib.util.spec_from_file_location('pagedserve_test_hooks', {str(hooks)!r})\n"
        "_hooks = importlib.util.module_from_spec(_spec)\n_spec.loader.exec_module(_hooks)\n"
        f"_hooks.install({delay!r}, *{paths!r})\n" + model_py.read_text())


def batch_sizes(batch_log: Path, since: int = 0) -> list[int]:
    """The batch log's entries from number `since` on: per forward pass, the samples it gave a token."""
    if not batch_log.exists():
        return []
    return [int(line) for line in batch_log.read_text().splitlines()[since:]]


@contextmanager
def paced(pace_file: Path, seconds: float):
    """Every forward pass with work takes at least `seconds` while inside: so long that requests
    sent together reach the engine together, however busy the machine (the adapter's threads wait
    for the interpreter lock while a tiny model's steps hold it; its decode steps take under a ms)."""
    staged = pace_file.with_name(pace_file.name + ".new")
    staged.write_text(str(seconds))
    staged.replace(pace_file)  # whole: the server never reads half of it
    try:
        yield
    finally:
        pace_file.unlink(missing_ok=True)


def largest_gap(times: list[float]) -> float:
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def assert_no_stall(measure, tries: int = 3) -> None:
    """measure(with_huge: bool) -> the largest gap between one stream's deltas. A huge request
    handled on the engine thread stalls the stream every time; a busy shared machine (other
    processes, nice 19) stalls it now and then. So the best of `tries` streams with the huge
    requests beside them must stay within stall_bound of the worst baseline stream."""
    baselines, with_huge = [], []
    for _ in range(tries):
        baselines.append(measure(False))
        with_huge.append(measure(True))
        if min(with_huge) < stall_bound(max(baselines)):
            return
    raise AssertionError(f"a stream stalled beside a huge request: largest gaps {with_huge} s, "
                         f"without it {baselines} s")


def stall_bound(baseline_gap: float) -> float:
    """What the largest gap may grow to while a huge request is refused beside the stream: a few
    baseline gaps (machine noise), never the seconds tokenizing a huge prompt on the engine thread
    took (about 10 s for 16 MB here)."""
    return 3 * baseline_gap + 0.5
