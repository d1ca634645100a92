"""Workloads for `pagedserve tune`: request lengths and arrival times, recorded or given.

A workload file is JSONL, one request per line, lengths and times only, never text:

    {"arrival_time": 0.0, "prompt_tokens": 412, "output_tokens": 57}

`arrival_time` is seconds from the first request. The servers write this format when
`record_workload` names a file (engine.json key, or `--record-workload PATH`): one line per
finished sample, appended and flushed as it finishes. `load_workload` also reads the shared
reference workload format (a JSON object {"requests": [{"prompt_ids": [...], "max_new_tokens": n}]},
no arrival times), and without arrival times spreads requests as a Poisson process at
`arrival_rate` requests/s (seeded), or sends them all at t=0.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.core.errors import ConfigError
from pagedserve.core.validation import parse_json_object


@dataclass(frozen=True, slots=True)
class WorkloadItem:
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    prompt_ids: tuple[int, ...] | None = None
    """Real token ids when the file has them (the reference format); else the replay draws them."""


class WorkloadRecorder:
    """Appends one JSONL line per finished sample: arrival offset, prompt and output lengths."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"record_workload={str(path)!r}: cannot open it for appending ({exc.strerror}); "
                              "name a writable file") from None
        self._t0: float | None = None
        self._lock = threading.Lock()

    def record(self, arrival: float, num_prompt_tokens: int, num_output_tokens: int) -> None:
        with self._lock:
            if self._t0 is None:
                self._t0 = arrival
            line = {"arrival_time": round(max(arrival - self._t0, 0.0), 6), "prompt_tokens": num_prompt_tokens,
                    "output_tokens": num_output_tokens}
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _int_field(where: str, obj: dict[str, Any], key: str, low: int) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{where}: {key}={value!r}; expected an integer >= {low}")
    return value


def _from_jsonl(path: Path, text: str) -> list[WorkloadItem]:
    items = []
    for i, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path} line {i}"
        obj = parse_json_object(raw, ConfigError, where, 'each line is an object such as '
                                '{"arrival_time": 0.0, "prompt_tokens": 100, "output_tokens": 20}')
        t = obj.get("arrival_time")
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0):
            raise ConfigError(f"{where}: arrival_time={t!r}; expected seconds >= 0")
        items.append(WorkloadItem(float(t) if t is not None else -1.0, _int_field(where, obj, "prompt_tokens", 1),
                                  _int_field(where, obj, "output_tokens", 1)))
    return items


def _from_reference(path: Path, data: dict[str, Any]) -> list[WorkloadItem]:
    items = []
    for i, entry in enumerate(data["requests"]):
        where = f"{path} requests[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt_ids"), list) or not entry["prompt_ids"]:
            raise ConfigError(f"{where}: expected {{'prompt_ids': [int, ...], 'max_new_tokens': int}}")
        n = _int_field(where, entry, "max_new_tokens", 1)
        items.append(WorkloadItem(-1.0, len(entry["prompt_ids"]), n, tuple(entry["prompt_ids"])))
    return items


def load_workload(path: str | Path, arrival_rate: float | None = None, seed: int = 0) -> list[WorkloadItem]:
    """Requests sorted by arrival time. Items without an arrival time get one from arrival_rate
    (Poisson, seeded) or 0.0; with arrival_rate given, it replaces the file's times."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"workload file {path} not found") from None
    stripped = text.lstrip()
    items: list[WorkloadItem] | None = None
    if stripped.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # JSONL: several objects
        if isinstance(data, dict) and isinstance(data.get("requests"), list):
            items = _from_reference(path, data)
    if items is None:
        items = _from_jsonl(path, text)
    if not items:
        raise ConfigError(f"workload file {path} holds no requests")
    if arrival_rate is not None or any(it.arrival_time < 0 for it in items):
        rng = random.Random(seed)
        t, timed = 0.0, []
        for it in items:
            timed.append(WorkloadItem(t if arrival_rate else 0.0, it.prompt_tokens, it.output_tokens, it.prompt_ids))
            if arrival_rate:
                t += rng.expovariate(arrival_rate)
        items = timed
    return sorted(items, key=lambda it: it.arrival_time)
