"""bench/serving/compare_scheduling.py: both modes at each rate back to back, compared at a fixed latency target."""

import pytest

from bench.serving.compare_scheduling import summarize_modes, sweep


def point(rate, throughput, latency):
    return {"rate": rate, "throughput": throughput, "p50_normalized_latency": latency}


def test_the_sweep_interleaves_the_modes_at_every_rate():
    calls, saved = [], []
    points = {"iteration": [], "request": []}

    def measure(mode, rate):
        calls.append((mode, rate))
        return point(rate, rate / 2, 0.001)

    sweep([20, 40, 80], measure, points, lambda mode, p: saved.append((mode, p["rate"], len(points[mode]))))
    assert calls == [
        ("iteration", 20),
        ("request", 20),
        ("request", 40),
        ("iteration", 40),
        ("iteration", 80),
        ("request", 80),
    ]
    assert saved == [(m, r, i // 2 + 1) for i, (m, r) in enumerate(calls)]  # each point is saved as it comes
    assert [p["rate"] for p in points["iteration"]] == [p["rate"] for p in points["request"]] == [20, 40, 80]


def test_throughput_at_a_fixed_target_and_the_ratio():
    modes = {
        "iteration": [point(20, 20.0, 0.004), point(40, 40.0, 0.006), point(80, 60.0, 0.010)],
        "request": [point(20, 18.0, 0.008), point(40, 22.0, 0.020), point(80, 23.0, 0.050)],
    }
    s = summarize_modes(modes, 0.008)
    # iteration: 8 ms lies halfway from 6 to 10 ms -> halfway from 40 to 60 req/s; request: only its first point.
    assert s["latency_target_s"] == 0.008 and s["target_fixed"]
    assert s["throughput_req_s"] == {"iteration": pytest.approx(50.0), "request": 18.0}
    assert s["ratio"] == pytest.approx(50.0 / 18.0)
    # The old default: 2x the best p50 seen (4 ms -> 8 ms here, but it moves as the engine gets faster).
    assert summarize_modes(modes, None)["latency_target_s"] == 0.008
    assert not summarize_modes(modes, None)["target_fixed"]
    # Request-level never meets 5 ms: no ratio (JSON has no infinity), iteration-level still reported.
    s = summarize_modes(modes, 0.005)
    assert s["throughput_req_s"] == {"iteration": pytest.approx(30.0), "request": 0.0} and s["ratio"] is None
