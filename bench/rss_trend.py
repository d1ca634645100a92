"""A process's resident memory against the number of requests it has served: sampled while a
benchmark runs, then split into warm-up and the rest, where a straight line fitted to RSS over
requests tells a leak (a slope) from a high-water mark (flat).

Why per request and not per second: a leak grows with the work done, and on a shared machine the
requests per second vary run to run by several times; MiB per 1,000 requests is comparable across
hosts and loads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

MIB = 2**20


def rss_bytes(pid: int) -> int:
    """Resident set size of a live process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS")


@dataclass(frozen=True)
class RssSample:
    seconds: float
    """Since the load began."""
    requests: int
    """Requests answered by then."""
    rss: int
    """Bytes."""


class RssSampler:
    """Samples a process's RSS every `every` seconds while the load runs (a task on the load's loop:
    reading /proc costs microseconds)."""

    def __init__(self, pid: int, count_requests: Callable[[], int], every: float = 2.0,
                 csv: Path | None = None) -> None:
        """csv: also append each sample there as it is taken (seconds,requests,rss_mib), so a long
        run that dies still leaves its trend behind."""
        self.pid, self.count_requests, self.every, self.csv = pid, count_requests, every, csv
        self.samples: list[RssSample] = []
        self._began = time.monotonic()
        if csv is not None:
            csv.write_text("seconds,requests,rss_mib\n")

    def sample(self) -> RssSample:
        s = RssSample(time.monotonic() - self._began, self.count_requests(), rss_bytes(self.pid))
        self.samples.append(s)
        if self.csv is not None:
            with self.csv.open("a") as f:
                f.write(f"{s.seconds:.1f},{s.requests},{s.rss / MIB:.1f}\n")
        return s

    async def run(self, until: float) -> None:
        self._began = time.monotonic()
        while True:
            self.sample()
            if time.monotonic() >= until:
                return
            await asyncio.sleep(min(self.every, max(until - time.monotonic(), 0)))


def slope_mib_per_1000(samples: Sequence[RssSample]) -> float:
    """Least-squares slope of RSS over requests served, in MiB per 1,000 requests (nan when the
    samples span fewer than two request counts)."""
    n = len(samples)
    if n < 2:
        return float("nan")
    mean_x = sum(s.requests for s in samples) / n
    mean_y = sum(s.rss for s in samples) / n
    var = sum((s.requests - mean_x) ** 2 for s in samples)
    if var == 0:
        return float("nan")
    cov = sum((s.requests - mean_x) * (s.rss - mean_y) for s in samples)
    return cov / var * 1000 / MIB


def after_warmup(samples: Sequence[RssSample], warmup_requests: int) -> list[RssSample]:
    """The samples taken once at least `warmup_requests` requests had been answered."""
    return [s for s in samples if s.requests >= warmup_requests]


def trace(samples: Sequence[RssSample], points: int = 12) -> str:
    """About `points` evenly spaced samples as `requests:MiB`, for the printed report."""
    if not samples:
        return "no samples"
    step = max(len(samples) // points, 1)
    picked = list(samples[::step])
    if picked[-1] is not samples[-1]:
        picked.append(samples[-1])
    return " ".join(f"{s.requests}:{s.rss / MIB:.0f}" for s in picked)


def warmup_requests_for(samples: Sequence[RssSample], wanted: int, share: float = 0.25) -> int:
    """Requests that count as warm-up: `wanted`, or `share` of the run's requests when the run
    answered fewer than wanted / share (a slow host still leaves most of its run to check)."""
    total = samples[-1].requests if samples else 0
    return min(wanted, int(total * share))


@dataclass(frozen=True)
class RssTrend:
    """What a run's samples say about the memory after warm-up."""

    warmup_requests: int
    at_warmup: RssSample
    """The first sample taken once warm-up was over."""
    peak_after: int
    """Highest RSS at or after warm-up, bytes."""
    end: RssSample
    slope: float
    """MiB per 1,000 requests, fitted to the samples after warm-up."""

    @property
    def growth_after(self) -> int:
        """Bytes: the higher of the end and the peak after warm-up, over RSS at warm-up."""
        return max(self.end.rss, self.peak_after) - self.at_warmup.rss


def trend_after_warmup(samples: Sequence[RssSample], wanted_warmup: int) -> RssTrend | None:
    """None when there are no samples past warm-up."""
    warmup = warmup_requests_for(samples, wanted_warmup)
    warm = after_warmup(samples, warmup)
    if not warm:
        return None
    return RssTrend(warmup, warm[0], max(s.rss for s in warm), warm[-1], slope_mib_per_1000(warm))
