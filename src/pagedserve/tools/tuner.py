"""`pagedserve tune`: the engine settings with the best throughput that still meet a latency SLO.

    pagedserve tune --workload FILE --ttft-p95 LIMIT [--itl-p95 LIMIT] [--arrival-rate R]
                    [--max-trials 8] [--output tuned-engine.json] [--plot tune.png] [engine flags]

Each trial builds an engine with one setting, replays the workload in-process (tools/replay.py) and
measures output tokens/s, TTFT and ITL percentiles, KV usage and preemptions. The settings tried
are chosen by coordinate ascent from the starting config (the flags / --engine-config, else the
shipped defaults): along each knob (max_num_batched_tokens, max_num_seqs, scheduling_policy) step
to the neighbouring value while the score improves, until no neighbour does or the trial budget is
spent. Score: a setting that meets the SLO beats one that does not; among those that meet it, higher
throughput wins; among those that do not, the smaller overshoot wins (so the search walks toward
the SLO). That is the standard advice ("raise batch limits until throughput peaks without TTFT
passing your limit") done for you, without a full grid.

A LIMIT is seconds (`0.5`) or a fraction of what the starting setting measures in the same run
(`0.25x`: a quarter of the start's TTFT p95). A relative limit asks "this much better than what I
run now" and, since the start and every other setting are measured minutes apart at most on the
same host, means the same on a fast machine and a slow one.

Writes the best setting that meets the SLO as a flat engine.json (loadable by --engine-config and
by the Triton model's engine.json) and, with matplotlib installed (`pip install pagedserve[tune]`),
a PNG of throughput against TTFT p95 for every setting tried. Exit status 1 if none met the SLO.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.core.config import SCHEDULING_POLICIES, EngineConfig
from pagedserve.tools.engine_args import add_engine_args
from pagedserve.tools.replay import ReplayResult

LADDERS: dict[str, tuple[Any, ...]] = {
    "max_num_batched_tokens": (128, 256, 512, 1024, 2048, 4096),
    "max_num_seqs": (4, 8, 16, 32, 64, 128, 256),
    "scheduling_policy": SCHEDULING_POLICIES,
}
"""The knobs the search walks, each an ordered ladder (a start value off the ladder is added)."""


@dataclass(frozen=True)
class Slo:
    ttft_p95_s: float
    itl_p95_s: float | None = None

    def overshoot(self, r: ReplayResult) -> float:
        """max(measured / limit) over the limits: <= 1.0 means the SLO is met."""
        ratios = [r.ttft_p95_s / self.ttft_p95_s]
        if self.itl_p95_s is not None:
            ratios.append(r.itl_p95_s / self.itl_p95_s)
        return max(ratios)

    def met(self, r: ReplayResult) -> bool:
        return self.overshoot(r) <= 1.0


@dataclass(frozen=True)
class Trial:
    settings: dict[str, Any]
    result: ReplayResult
    meets_slo: bool

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.settings.items())


def score(trial: Trial, slo: Slo) -> tuple:
    if trial.meets_slo:
        return (1, trial.result.output_tokens_per_s)
    return (0, -slo.overshoot(trial.result))


def search(measure: Callable[[dict[str, Any]], ReplayResult], start: dict[str, Any], slo: Slo,
           max_trials: int = 8, ladders: dict[str, tuple[Any, ...]] = LADDERS,
           on_trial: Callable[[int, Trial], None] | None = None) -> list[Trial]:
    """Coordinate ascent over `ladders` from `start`; returns every trial in the order run
    (on_trial(index, trial) is called as each one finishes)."""
    ladders = {k: (v if start[k] in v else tuple(sorted((*v, start[k]), key=_order_key))) for k, v in ladders.items()}
    trials: list[Trial] = []
    seen: dict[tuple, Trial] = {}

    def run(settings: dict[str, Any]) -> Trial | None:
        key = tuple(settings[k] for k in ladders)
        if key in seen:
            return seen[key]
        if len(trials) >= max_trials:
            return None
        result = measure(settings)
        trial = Trial(dict(settings), result, slo.met(result))
        trials.append(trial)
        seen[key] = trial
        if on_trial is not None:
            on_trial(len(trials) - 1, trial)
        return trial

    best = run(dict(start))
    improved = True
    while improved and len(trials) < max_trials:
        improved = False
        for knob, ladder in ladders.items():
            for direction in (1, -1):
                moved = False
                while True:
                    i = ladder.index(best.settings[knob]) + direction
                    if not 0 <= i < len(ladder):
                        break
                    trial = run({**best.settings, knob: ladder[i]})
                    if trial is None or score(trial, slo) <= score(best, slo):
                        break
                    best, moved, improved = trial, True, True
                if moved:
                    break  # this knob found its direction; do not walk back
    return trials


def _order_key(value: Any) -> tuple:
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def best_trial(trials: list[Trial]) -> Trial | None:
    ok = [t for t in trials if t.meets_slo]
    return max(ok, key=lambda t: t.result.output_tokens_per_s) if ok else None


TABLE_HEAD = (f"{'#':>2}  {'max_num_batched_tokens':>22} {'max_num_seqs':>12} {'policy':>10}  {'out tok/s':>9} "
              f"{'TTFT p50':>8} {'TTFT p95':>8} {'ITL p50':>8} {'ITL p95':>8} {'KV peak':>7} {'preempt':>7}  SLO")


def format_row(i: int, t: Trial, best: Trial | None = None) -> str:
    r, s = t.result, t.settings
    mark = "met" + (" <- best" if t is best else "") if t.meets_slo else "missed"
    return (f"{i:>2}  {s['max_num_batched_tokens']:>22} {s['max_num_seqs']:>12} {s['scheduling_policy']:>10}  "
            f"{r.output_tokens_per_s:>9.1f} {r.ttft_p50_s:>8.3f} {r.ttft_p95_s:>8.3f} {r.itl_p50_s:>8.3f} "
            f"{r.itl_p95_s:>8.3f} {r.kv_usage_peak:>7.0%} {r.num_preemptions:>7}  {mark}")


def format_table(trials: list[Trial], best: Trial | None) -> str:
    return "\n".join([TABLE_HEAD] + [format_row(i, t, best) for i, t in enumerate(trials)])


def plot(trials: list[Trial], best: Trial | None, slo: Slo, path: Path) -> bool:
    """Throughput against TTFT p95, one point per trial. False if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, t in enumerate(trials):
        color = "tab:green" if t.meets_slo else "tab:red"
        ax.scatter(t.result.ttft_p95_s, t.result.output_tokens_per_s, color=color, s=80 if t is best else 30,
                   edgecolors="black" if t is best else "none", zorder=3)
        ax.annotate(str(i), (t.result.ttft_p95_s, t.result.output_tokens_per_s), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    ax.axvline(slo.ttft_p95_s, color="gray", linestyle="--", label=f"TTFT p95 limit {slo.ttft_p95_s:g}s")
    ax.set_xlabel("TTFT p95 (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("pagedserve tune: settings tried (green: SLO met; numbers: trial #)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def make_measure(base: EngineConfig, items, warmup: bool = True) -> Callable[[dict[str, Any]], ReplayResult]:
    """A measure(settings) that builds an engine with `base` + settings and replays `items`."""
    from pagedserve.core.engine import LLMEngine
    from pagedserve.core.sampling_params import SamplingParams
    from pagedserve.tools.replay import prompt_ids_for, replay

    prompts: list[list[int]] | None = None

    def measure(settings: dict[str, Any]) -> ReplayResult:
        nonlocal prompts
        engine = LLMEngine(base.replace(**settings, record_workload=None))  # never record a replay
        if prompts is None:
            prompts = prompt_ids_for(items, engine.arch.vocab_size)
        if warmup:  # first-call costs (allocation, kernel build) are not the setting's fault
            engine.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        result = replay(engine, items, prompts)
        del engine
        gc.collect()
        return result

    return measure


@dataclass(frozen=True)
class Limit:
    """One SLO limit: seconds, or (relative) a fraction of the start setting's own measurement."""

    value: float
    relative: bool = False

    @classmethod
    def parse(cls, text: str) -> Limit:
        relative = text.strip().lower().endswith("x")
        number = text.strip()[:-1] if relative else text
        try:
            value = float(number)
        except ValueError:
            raise ValueError(f"{text!r} is neither seconds (0.5) nor a fraction of the start's (0.25x)") from None
        if not value > 0:
            raise ValueError(f"{text!r} must be > 0")
        return cls(value, relative)

    def seconds(self, start_measured: float) -> float:
        return self.value * start_measured if self.relative else self.value

    def __str__(self) -> str:
        return f"{self.value:g}x the start's" if self.relative else f"{self.value:g}s"


def tune(base: EngineConfig, items, slo: Slo | tuple[Limit, Limit | None], max_trials: int,
         progress: bool = False) -> tuple[Slo, list[Trial]]:
    """Search from `base`'s settings; a (ttft, itl) pair of Limits becomes the Slo once the start
    is measured (its first trial, so it is not measured twice). Returns the Slo and the trials."""
    start = {k: base.to_dict()[k] for k in LADDERS}
    on_trial = None
    if progress:
        print(f"trials as they finish:\n{TABLE_HEAD}", file=sys.stderr, flush=True)
        on_trial = lambda i, t: print(format_row(i, t), file=sys.stderr, flush=True)  # noqa: E731
    measure = make_measure(base, items)
    if not isinstance(slo, Slo):
        ttft, itl = slo
        first = measure(start)
        slo = Slo(ttft.seconds(first.ttft_p95_s), None if itl is None else itl.seconds(first.itl_p95_s))
        if progress:
            print(f"start measured: TTFT p95 {first.ttft_p95_s:.4g}s, ITL p95 {first.itl_p95_s:.4g}s; SLO TTFT p95 <= "
                  f"{slo.ttft_p95_s:.4g}s" + (f", ITL p95 <= {slo.itl_p95_s:.4g}s" if slo.itl_p95_s else ""),
                  file=sys.stderr, flush=True)
        measure = _first_call_answered(measure, start, first)
    return slo, search(measure, start, slo, max_trials, on_trial=on_trial)


def _first_call_answered(measure, settings: dict[str, Any], result: ReplayResult):
    pending = [(settings, result)]

    def answer(asked: dict[str, Any]) -> ReplayResult:
        if pending and pending[0][0] == asked:
            return pending.pop()[1]
        return measure(asked)

    return answer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True, help="JSONL of arrival_time/prompt_tokens/output_tokens "
                   "(what --record-workload writes) or the reference {'requests': [...]} JSON")
    p.add_argument("--ttft-p95", required=True,
                   help="TTFT p95 limit: seconds (0.5), or a fraction of the starting setting's, measured in the "
                        "same run (0.25x)")
    p.add_argument("--itl-p95", default=None, help="inter-token latency p95 limit, seconds or a fraction (0.5x)")
    p.add_argument("--arrival-rate", type=float, default=None,
                   help="requests/s (Poisson, seeded); replaces the file's arrival times")
    p.add_argument("--max-trials", type=int, default=8, help="settings to try at most (default 8)")
    p.add_argument("--output", default="tuned-engine.json", help="where the best engine.json goes")
    p.add_argument("--plot", default="tune.png", help="PNG of throughput vs TTFT p95 ('' for none)")
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    import logging

    from pagedserve.core.errors import PagedServeError
    from pagedserve.core.workload import load_workload
    from pagedserve.tools.engine_args import engine_config_from_args

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.arrival_rate is not None and args.arrival_rate <= 0:
        print(f"pagedserve tune: error: --arrival-rate must be > 0 (got {args.arrival_rate})", file=sys.stderr)
        return 2
    limits = []
    for name in ("ttft_p95", "itl_p95"):
        text = getattr(args, name)
        try:
            limits.append(None if text is None else Limit.parse(text))
        except ValueError as exc:
            print(f"pagedserve tune: error: --{name.replace('_', '-')}: {exc}", file=sys.stderr)
            return 2
    if args.max_trials < 1:
        print("pagedserve tune: error: --max-trials must be at least 1", file=sys.stderr)
        return 2
    try:
        base = engine_config_from_args(args)
        items = load_workload(args.workload, args.arrival_rate)
        ttft, itl = limits
        print(f"workload {args.workload}: {len(items)} requests over {items[-1].arrival_time:.1f}s; SLO TTFT p95 <= "
              f"{ttft}" + (f", ITL p95 <= {itl}" if itl else ""), flush=True)
        slo, trials = tune(base, items, (ttft, itl), args.max_trials, progress=True)
        if ttft.relative or (itl is not None and itl.relative):
            print(f"SLO from the start's measurement: TTFT p95 <= {slo.ttft_p95_s:.4g}s"
                  + (f", ITL p95 <= {slo.itl_p95_s:.4g}s" if slo.itl_p95_s else ""), flush=True)
    except PagedServeError as exc:
        print(f"pagedserve tune: error: {exc}", file=sys.stderr)
        return 2
    best = best_trial(trials)
    print(format_table(trials, best))
    if args.plot:
        if plot(trials, best, slo, Path(args.plot)):
            print(f"plot: {args.plot}")
        else:
            print("plot skipped: matplotlib is not installed (pip install 'pagedserve[tune]')", file=sys.stderr)
    if best is None:
        print("no setting tried met the SLO: relax the limits, lower --arrival-rate, or raise --max-trials; "
              "no engine.json written", file=sys.stderr)
        return 1
    Path(args.output).write_text(json.dumps(base.replace(**best.settings).to_dict(), indent=2) + "\n")
    print(f"best meeting the SLO: {best.label()} ({best.result.output_tokens_per_s:.1f} tok/s, TTFT p95 "
          f"{best.result.ttft_p95_s:.3f}s) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
