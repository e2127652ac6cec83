"""benchmarks/bench_sync.py as a script: a tiny model, one receiver, a few repetitions.
Checks the JSON it prints is complete and self-consistent, not how fast anything is."""
import json
import subprocess
import sys

from conftest import ROOT, subprocess_env

SCRIPT = ROOT / "benchmarks/bench_sync.py"


def test_bench_sync_prints_consistent_json():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--sizes-mb", "2", "--receivers", "1", "--reps", "3",
                           "--bucket-mb", "0.5", "--cpu", "--timeout-s", "30"],
                          capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    measurements = [line for line in lines if line["kind"] == "measurement"]
    comparisons = [line for line in lines if line["kind"] == "comparison"]
    summary = lines[-1]
    assert summary["kind"] == "summary" and summary["device"] == "cpu" and summary["backend"] == "gloo"

    modes = {m["mode"]: m for m in measurements}
    assert {"flat", "bucketed", "unverified", "nocopy"} <= set(modes)
    for m in measurements:
        assert m["reps"] == 3 and len(m["times_s"]) == 3 and all(t > 0 for t in m["times_s"])
        assert m["median_s"] > 0 and m["gbps"] > 0 and m["receivers"] == 1 and m["device"] == "cpu"
        assert abs(m["gbps"] - m["model_mb"] * 2**20 / m["median_s"] / 1e9) <= 0.01 * m["gbps"] + 1e-3
    assert modes["bucketed"]["buckets"] > 1  # 0.5 MB buckets: the model spans several
    assert all(m["schedule"] == "chain" for m in measurements)  # gloo, several buckets
    assert modes["bucketed"]["publish_median_s"] > 0 and modes["bucketed"]["wire_median_s"] > 0
    assert modes["bucketed"]["fingerprint_median_s"] > 0  # rank 0 fingerprinted the verified rounds

    (cmp,) = comparisons
    assert cmp["flat_gbps"] == modes["flat"]["gbps"] and cmp["bucketed_gbps"] == modes["bucketed"]["gbps"]
    ratio = cmp["bucketed_gbps"] / cmp["flat_gbps"]
    assert abs(cmp["bucketed_over_flat"] - ratio) < 1e-3 * cmp["bucketed_over_flat"] + 1e-3
    assert summary["bucketed_over_flat"] == cmp["bucketed_over_flat"]
    assert summary["meets_0_8"] == (summary["bucketed_over_flat"] >= 0.8)
    share = 1 - modes["unverified"]["median_s"] / modes["bucketed"]["median_s"]
    assert abs(cmp["verify_share"] - share) < 1e-3 and summary["verify_share_max"] == cmp["verify_share"]


def test_bench_sync_across_rate_limited_nodes(tmp_path):
    """--link-mbit: rank 0 and 2 receivers on nodes of their own (network namespaces,
    root only), every link at 200 Mbit/s: no mode can beat the time the payload takes on
    one link, so the rate limit and the nodes' addresses were really in the path."""
    import pytest
    from conftest import load_script

    reason = load_script("netns_bed").Bed.unavailable()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--sizes-mb", "4", "--receivers", "2", "--reps", "2",
                           "--warmup", "1", "--bucket-mb", "1", "--cpu", "--timeout-s", "30", "--link-mbit", "200"],
                          capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    measurements = [m for m in lines if m["kind"] == "measurement"]
    assert {m["mode"] for m in measurements} == {"flat", "bucketed", "unverified", "nocopy"}
    for m in measurements:
        assert m["link_mbit"] == 200 and m["over_link_s"] >= 0.9, m
    assert lines[-1]["link_mbit"] == 200
