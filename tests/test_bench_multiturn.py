"""bench/serving/bench_multiturn.py end to end on a tiny workload, against the conftest servers (caching on, off)."""

import json

from bench.serving import bench_multiturn


def test_bench_multiturn_tiny_workload(server_factory, tmp_path, capsys):
    out = tmp_path / "multiturn.json"
    rc = bench_multiturn.main(
        [
            "--conversations",
            "2",
            "--turns",
            "2",
            "--max-tokens",
            "4",
            "--repeats",
            "1",
            "--system-tokens",
            "40",
            "60",
            "--out",
            str(out),
        ],
        # The conftest servers (float32, leak checks on exit) instead of the script's own launcher.
        serve=lambda mode_flags, name: server_factory(*mode_flags),
    )
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    report = json.loads(out.read_text())
    assert {"command", "machine", "config", "modes", "runs", "summary", "summary_line"} <= set(report)
    assert report["machine"]["cpus"] and report["machine"]["platform"]
    assert report["config"]["conversations"] == 2 and report["config"]["turns"] == 2
    for mode in ("on", "off"):
        m = report["modes"][mode]
        assert m["failed"] == 0
        assert len(m["ttft_p50_s"]) == len(m["ttft_p90_s"]) == 2 and all(x > 0 for x in m["ttft_p50_s"])
        assert m["ttft_p50_later_turns_s"] > 0 and m["output_tok_s"] > 0
        assert m["prompt_tokens_mean"][1] > m["prompt_tokens_mean"][0]  # turn 2 resends turn 1 and its reply
        [run] = report["runs"][mode]
        assert [len(t) for t in run["ttft_s"]] == [2, 2] and run["output_tokens"] > 0
    on, off = report["modes"]["on"], report["modes"]["off"]
    # Turn 2 shares at least the 40-token system prompt (two 16-token blocks) with turn 1, per conversation.
    assert on["prefix_cache_hit_tokens"] >= 2 * 32 and 0 < on["hit_rate"] < 1
    assert off["prefix_cache_hit_tokens"] == 0 and off["hit_rate"] == 0
    s = report["summary"]
    assert s["ttft_p50_later_turns_ratio_off_on"] > 0 and s["throughput_ratio_on_off"] > 0
    assert isinstance(s["goal_met"], bool)
    assert report["summary_line"] in stdout and "hit rate" in stdout
