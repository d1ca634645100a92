"""bench/rss_trend.py: the slope and the warm-up split bench/soak.py bounds RSS with."""

from __future__ import annotations

import math

from bench.rss_trend import MIB, RssSample, slope_mib_per_1000, trend_after_warmup, warmup_requests_for


def samples(rss_mib_of) -> list[RssSample]:
    return [RssSample(float(n), n, int(rss_mib_of(n) * MIB)) for n in range(0, 2001, 10)]


def test_a_leak_shows_as_its_slope_and_a_high_water_mark_as_flat():
    leak = samples(lambda n: 700 + 0.004 * n)  # 4 KiB per request
    assert math.isclose(slope_mib_per_1000(leak), 4.0, rel_tol=1e-6)
    plateau = samples(lambda n: 700 + min(n, 200) * 1.0)  # +200 MiB over the first 200, then flat
    trend = trend_after_warmup(plateau, 300)
    assert trend.warmup_requests == 300 and trend.at_warmup.requests == 300
    assert trend.slope == 0.0 and trend.growth_after == 0
    assert math.isclose(trend_after_warmup(leak, 300).growth_after / MIB, 0.004 * 1700, rel_tol=1e-6)


def test_a_short_run_warms_up_on_a_quarter_of_its_requests_and_a_late_peak_counts():
    run = [RssSample(float(n), n, (700 + (50 if n == 80 else 0)) * MIB) for n in range(0, 101, 10)]
    assert warmup_requests_for(run, 300) == 25
    trend = trend_after_warmup(run, 300)
    assert trend.at_warmup.requests == 30 and trend.growth_after == 50 * MIB


def test_no_samples_or_one_request_count_give_no_slope():
    assert trend_after_warmup([], 300) is None
    assert math.isnan(slope_mib_per_1000([RssSample(0.0, 5, MIB), RssSample(1.0, 5, 2 * MIB)]))
