"""analysis/staleness.py and analysis/throughput.py: run as scripts on small real run
directories (one asynchronous, one synchronous max_staleness=0 run of 6 steps) and on a
hand-written run directory whose trace.json has known time shares.

The tables' figures are recomputed here from metrics.jsonl and trace.json directly.
The trace-based outputs of the real runs are checked when the runs write trace.json
(required once async_rl/run/tracing.py exists); the metrics-only path on a copy of a run
without its trace.json.
"""
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_metrics, subprocess_env, train

from async_rl.run.directory import RunDir

ROOT = Path(__file__).resolve().parents[2]
STALENESS = ROOT / "analysis/staleness.py"
THROUGHPUT = ROOT / "analysis/throughput.py"
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
TINY = ["train.max_steps=6", "learner.ranks=1"]
TRACING = (ROOT / "async_rl/run/tracing.py").exists()  # where runs write trace.json


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, demo_model):
    run_dir = tmp_path_factory.mktemp("analysis") / "async"
    train(run_dir, demo_model, *TINY, "max_staleness=2")
    return run_dir


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, demo_model):
    run_dir = tmp_path_factory.mktemp("analysis") / "sync"
    train(run_dir, demo_model, *TINY, "max_staleness=0")
    return run_dir


def script(path: Path, *args) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(path), *map(str, args)], capture_output=True, text=True, timeout=60,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def tables(text: str) -> list[list[dict]]:
    """Every markdown table in `text`, as a list of {header: cell} rows."""
    out, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            out.append([dict(zip(block[0], row)) for row in block[2:]])
            block = []
    return out


def table_after(text: str, title: str) -> list[dict]:
    return tables(text.split(title, 1)[1])[0]


def pct(cell: str) -> float:
    assert cell.endswith("%"), cell
    return float(cell[:-1]) / 100


def assert_pngs(directory: Path, *names: str) -> None:
    if not HAVE_MATPLOTLIB:
        return
    for name in names:
        data = (directory / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


# -- independent figures ------------------------------------------------------------------
def expected_staleness(run_dir: Path) -> dict:
    steps, _ = read_metrics(run_dir)
    counts: dict[int, int] = {}
    for s in steps:
        for key, value in s.items():
            if key.startswith("staleness/count_"):
                counts[int(key.split("_")[-1])] = counts.get(int(key.split("_")[-1]), 0) + value
    total = sum(counts.values())
    ess = [s["is/ess"] for s in steps]
    return {"steps": steps[-1]["step"], "samples": steps[-1]["train/samples"], "total": total,
            "mean": sum(k * n for k, n in counts.items()) / total, "max": max(k for k, n in counts.items() if n),
            "fractions": {k: n / total for k, n in counts.items()}, "ess_mean": sum(ess) / len(ess),
            "ess_min": min(ess), "dropped": steps[-1]["staleness/dropped"]}


def expected_throughput(run_dir: Path) -> dict:
    steps, _ = read_metrics(run_dir)
    elapsed = steps[-1]["time"] - steps[0]["time"]
    samples = tokens = busy = waited = 0.0
    for prev, cur in zip(steps, steps[1:]):
        n = cur["train/samples"] - prev["train/samples"]
        samples += n
        tokens += cur["train/response_len_mean"] * n  # the step's generated tokens
        duration = n / cur["throughput/samples_per_s"]
        busy += duration
        waited += cur["learner/idle_frac"] * duration
    return {"steps": steps[-1]["step"], "wall": steps[-1]["time"], "samples_per_s": samples / elapsed,
            "tokens_per_s": tokens / elapsed, "idle": waited / busy,
            "sync": sum(s["sync/seconds"] for s in steps) / len(steps)}


def check_staleness_row(row: dict, run_dir: Path, max_staleness: int, ks: list[int]) -> None:
    e = expected_staleness(run_dir)
    assert e["total"] == e["samples"] > 0  # every trained sample is in the histogram
    assert row["max_staleness"] == str(max_staleness)
    assert (row["steps"], row["samples"]) == (str(e["steps"]), str(e["samples"]))
    assert float(row["staleness mean"]) == pytest.approx(e["mean"], abs=5e-4)
    assert row["staleness max"] == str(e["max"]) and e["max"] <= max_staleness
    for k in ks:
        assert pct(row[f"k={k}"]) == pytest.approx(e["fractions"].get(k, 0.0), abs=5e-4)
    assert float(row["ESS mean"]) == pytest.approx(e["ess_mean"], abs=5e-5)
    assert float(row["ESS min"]) == pytest.approx(e["ess_min"], abs=5e-5)
    assert row["dropped groups"] == str(e["dropped"])


def check_throughput_row(row: dict, run_dir: Path, max_staleness: int) -> dict:
    e = expected_throughput(run_dir)
    assert row["max_staleness"] == str(max_staleness) and row["steps"] == str(e["steps"])
    assert float(row["wall s"]) == pytest.approx(e["wall"], abs=0.051)
    assert float(row["samples/s"]) == pytest.approx(e["samples_per_s"], abs=0.051)
    assert float(row["gen tokens/s"]) == pytest.approx(e["tokens_per_s"], abs=0.051)
    assert pct(row["learner idle"]) == pytest.approx(e["idle"], abs=5e-4)
    assert float(row["sync s/step"]) == pytest.approx(e["sync"], abs=5e-5)
    return e


def trace_tracks(run_dir: Path) -> dict[str, list[dict]]:
    """Complete events of trace.json per process track name."""
    events = json.loads((run_dir / "trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    tracks: dict[str, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X":
            tracks.setdefault(names.get(e["pid"], str(e["pid"])), []).append(e)
    return tracks


def wait_share(events: list[dict], wait: str, since: float | None = None) -> float:
    """Share of the track's time from `since` (default: its first span) in `wait` spans."""
    since = min(e["ts"] for e in events) if since is None else since
    wall = max(e["ts"] + e["dur"] for e in events) - since
    return sum(max(0, e["ts"] + e["dur"] - max(e["ts"], since)) for e in events if e["name"] == wait) / wall


# -- real runs ------------------------------------------------------------------------------
def test_help_names_outputs():
    for path, name in [(STALENESS, "staleness_hist.png"), (THROUGHPUT, "time_shares.png")]:
        proc = script(path, "--help")
        assert name in proc.stdout and "--out" in proc.stdout


def test_staleness_one_run(async_run):
    proc = script(STALENESS, async_run)
    [rows] = tables(proc.stdout)
    assert len(rows) == 1 and rows[0]["run"] == "async"
    check_staleness_row(rows[0], async_run, 2, [k for k in range(3) if f"k={k}" in rows[0]])
    assert_pngs(async_run / "analysis", "staleness_hist.png", "staleness_time.png", "is_ess.png")
    assert not (async_run / "analysis" / "staleness_compare.png").exists()  # nothing to compare


def test_staleness_overlay(async_run, sync_run, tmp_path):
    proc = script(STALENESS, async_run, sync_run)
    [rows] = tables(proc.stdout)
    assert [r["run"] for r in rows] == ["async", "sync"]
    ks = sorted(int(h[2:]) for h in rows[0] if h.startswith("k="))
    assert 0 in ks and max(ks) <= 2
    check_staleness_row(rows[0], async_run, 2, ks)
    check_staleness_row(rows[1], sync_run, 0, ks)
    # On-policy: every sample has staleness 0, no importance correction.
    assert (rows[1]["staleness mean"], rows[1]["staleness max"], rows[1]["k=0"]) == ("0.000", "0", "100.0%")
    assert rows[1]["ESS min"] == "1.0000"
    for run_dir in (async_run, sync_run):
        assert_pngs(run_dir / "analysis", "staleness_hist.png", "staleness_time.png", "is_ess.png")
    assert_pngs(async_run / "analysis", "staleness_compare.png")  # the first run's directory by default
    assert not (sync_run / "analysis" / "staleness_compare.png").exists()
    script(STALENESS, async_run, sync_run, "--out", tmp_path / "cmp")
    assert_pngs(tmp_path / "cmp", "staleness_compare.png")


def test_throughput_async_vs_sync(async_run, sync_run):
    proc = script(THROUGHPUT, async_run, sync_run)
    rows = table_after(proc.stdout, "## Throughput")
    assert [r["run"] for r in rows] == ["async", "sync"]
    a = check_throughput_row(rows[0], async_run, 2)
    s = check_throughput_row(rows[1], sync_run, 0)
    assert float(rows[0]["samples/s vs max_staleness=0"][:-1]) == pytest.approx(
        a["samples_per_s"] / s["samples_per_s"], abs=0.006)
    assert rows[1]["samples/s vs max_staleness=0"] == "1.00x"
    assert_pngs(async_run / "analysis", "throughput.png", "throughput_compare.png")
    assert_pngs(sync_run / "analysis", "throughput.png")

    traced = [r for r in (async_run, sync_run) if (r / "trace.json").exists()]
    if TRACING:
        assert traced == [async_run, sync_run]
    for run_dir in {async_run, sync_run} - set(traced):
        assert f"{run_dir.name}: no trace.json" in proc.stdout
        assert not (run_dir / "analysis" / "time_shares.png").exists()
    if not traced:
        assert "## Time shares" not in proc.stdout
        assert rows[0]["actor idle (trace)"] == "—"
        return
    shares = table_after(proc.stdout, "## Time shares (trace)")
    idle = table_after(proc.stdout, "## Actor idle (trace)")
    for run_dir in traced:
        assert_pngs(run_dir / "analysis", "time_shares.png", "timeline.png")
        tracks = trace_tracks(run_dir)
        assert "learner" in tracks and any(t.startswith("actor-") for t in tracks), \
            (sorted(tracks), [log.read_text()[-1500:] for log in sorted((run_dir / "logs").glob("*.log"))])
        by_role = {r["role"]: r for r in shares if r["run"] == run_dir.name}
        assert set(by_role) == {"learner", "actor"}
        for r in by_role.values():  # the shares of a role's wall time add up to 1
            cells = [pct(c) for h, c in r.items() if h not in ("run", "role", "tracks", "wall s") and c != "—"]
            assert sum(cells) == pytest.approx(1.0, abs=0.006)
        assert pct(by_role["learner"]["train-step"]) > 0 and pct(by_role["actor"]["generate"]) > 0
        # The learner's time counts from its first train-step (start-up left out).
        first_train = min(e["ts"] for e in tracks["learner"] if e["name"] == "train-step")
        assert pct(by_role["learner"]["wait"]) == pytest.approx(
            wait_share(tracks["learner"], "wait-for-data", since=first_train), abs=5e-4)
        actors = {r["actor"]: r for r in idle if r["run"] == run_dir.name}
        assert set(actors) == {t for t in tracks if t.startswith("actor-")}
        for track, r in actors.items():
            assert pct(r["idle (wait-for-admission)"]) == pytest.approx(
                wait_share(tracks[track], "wait-for-admission"), abs=5e-4)
        row = rows[[async_run, sync_run].index(run_dir)]
        mean_idle = sum(wait_share(tracks[t], "wait-for-admission") for t in actors) / len(actors)
        assert pct(row["actor idle (trace)"]) == pytest.approx(mean_idle, abs=5e-4)


def test_throughput_without_trace(async_run, tmp_path):
    """Metrics alone (a run from before tracing, or with it off): the trace parts are skipped, saying so."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("metrics.jsonl", "config.yaml"):
        shutil.copy(async_run / name, bare / name)
    proc = script(THROUGHPUT, bare)
    [row] = table_after(proc.stdout, "## Throughput")
    check_throughput_row(row, bare, 2)
    assert row["actor idle (trace)"] == "—" and row["samples/s vs max_staleness=0"] == "—"
    assert "bare: no trace.json" in proc.stdout and "## Time shares" not in proc.stdout
    assert_pngs(bare / "analysis", "throughput.png")
    assert sorted(p.name for p in (bare / "analysis").iterdir()) == (["throughput.png"] if HAVE_MATPLOTLIB else [])


# -- a hand-written run directory -------------------------------------------------------------
T0 = 1_700_000_000_000_000  # microseconds since the epoch
MS = 1000


def span(pid: int, name: str, start_ms: float, end_ms: float) -> dict:
    return {"ph": "X", "name": name, "pid": pid, "tid": 1, "ts": T0 + start_ms * MS, "dur": (end_ms - start_ms) * MS}


HAND_TRACE = [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "learner"}},
    {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "actor-0"}},
    {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "actor-1"}},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}},
    {"ph": "i", "name": "marker", "pid": 1, "tid": 1, "ts": T0, "s": "p"},
    # learner: start-up (initial eval, first wait) until its first train-step at 100 ms, left
    # out; then 500 ms: train 300, sync 40, eval 40, checkpoint 50, wait 50, a 20 ms gap in no span
    span(1, "eval", 0, 30), span(1, "wait-for-data", 30, 100), span(1, "train-step", 100, 300),
    span(1, "sync", 300, 340), span(1, "eval", 360, 400), span(1, "checkpoint", 400, 450),
    span(1, "wait-for-data", 450, 500), span(1, "train-step", 500, 600),
    # actor-0, 500 ms: generate 330 (a span of unknown name nested in the second one takes 20),
    # score 20, push 10, wait 100, sync 20
    span(2, "generate", 0, 200), span(2, "score", 200, 220), span(2, "push", 220, 230),
    span(2, "wait-for-admission", 230, 330), span(2, "sync", 330, 350), span(2, "generate", 350, 500),
    span(2, "mystery", 400, 420),
    # actor-1 joins later, 310 ms: generate 200, wait 100, push 10
    span(3, "generate", 100, 300), span(3, "wait-for-admission", 300, 400), span(3, "push", 400, 410),
]
# Three steps of 32 samples: 0.1 s and 0.2 s after the first, 102.4 and 128 generated tokens.
HAND_STEPS = [
    {"time": 1.0, "step": 1, "train/samples": 32, "throughput/samples_per_s": 4.0,
     "throughput/gen_tokens_per_s": 12.8, "learner/idle_frac": 0.9, "sync/seconds": 0.01,
     "staleness/mean": 0.0, "staleness/max": 0, "staleness/count_0": 32, "is/ess": 1.0},
    {"time": 1.1, "step": 2, "train/samples": 64, "throughput/samples_per_s": 320.0,
     "throughput/gen_tokens_per_s": 1024.0, "learner/idle_frac": 0.5, "sync/seconds": 0.02,
     "staleness/mean": 1.0, "staleness/max": 1, "staleness/count_1": 32, "is/ess": 0.9},
    {"time": 1.3, "step": 3, "train/samples": 96, "throughput/samples_per_s": 160.0,
     "throughput/gen_tokens_per_s": 640.0, "learner/idle_frac": 0.25, "sync/seconds": 0.03,
     "staleness/mean": 1.5, "staleness/max": 2, "staleness/count_1": 16, "staleness/count_2": 16, "is/ess": 0.8},
]


@pytest.fixture
def hand_run(tmp_path):
    run_dir = tmp_path / "hand"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("max_staleness: 2\n")
    lines = [{"time": 0.0, "step": 0, "eval/accuracy": 0.5}]
    for i, s in enumerate(HAND_STEPS):
        lines.append({"version": s["step"], "loss/total": 0.0, "staleness/dropped": i // 2, **s})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run_dir / "trace.json").write_text(json.dumps({"traceEvents": HAND_TRACE, "displayTimeUnit": "ms"}))
    return run_dir


def import_analysis(name: str):
    sys.path.insert(0, str(ROOT / "analysis"))
    try:
        spec = importlib.util.spec_from_file_location(f"analysis_{name}", ROOT / "analysis" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "analysis"))


def test_time_shares_of_a_hand_written_trace(hand_run):
    throughput = import_analysis("throughput")
    spans = RunDir(hand_run).trace()
    roles = throughput.role_shares(spans)
    assert roles["learner"]["tracks"] == 1 and roles["learner"]["wall"] == pytest.approx(0.5)
    # (Epoch seconds in a float resolve ~0.2 us: hence abs=1e-5 on shares of a 0.5 s track.)
    assert roles["learner"]["shares"] == pytest.approx(
        {"wait": 0.1, "train-step": 0.6, "sync": 0.08, "eval": 0.08, "checkpoint": 0.1, "untracked": 0.04}, abs=1e-5)
    with_startup = throughput.role_shares(spans, startup=True)["learner"]
    assert with_startup["wall"] == pytest.approx(0.6)
    assert with_startup["shares"] == pytest.approx(
        {"wait": 0.2, "train-step": 0.5, "sync": 0.4 / 6, "eval": 0.7 / 6, "checkpoint": 0.5 / 6,
         "untracked": 0.2 / 6}, abs=1e-5)
    assert roles["actor"]["tracks"] == 2 and roles["actor"]["wall"] == pytest.approx(0.81)
    assert roles["actor"]["shares"] == pytest.approx(
        {"generate": 530 / 810, "score": 20 / 810, "push": 20 / 810, "wait": 200 / 810, "sync": 20 / 810,
         "other": 20 / 810, "untracked": 0.0}, abs=1e-5)
    idle = throughput.actor_idle(spans)
    assert list(idle) == ["actor-0", "actor-1"]
    assert idle["actor-0"] == pytest.approx({"wall": 0.5, "idle": 0.2}, abs=1e-5)
    assert idle["actor-1"] == pytest.approx({"wall": 0.31, "idle": 100 / 310}, abs=1e-5)

    proc = script(THROUGHPUT, hand_run)
    assert table_after(proc.stdout, "## Throughput") == [{
        "run": "hand", "max_staleness": "2", "steps": "3", "wall s": "1.3", "samples/s": "213.3",
        "gen tokens/s": "768.0", "learner idle": "33.3%", "actor idle (trace)": f"{(0.2 + 100 / 310) / 2:.1%}",
        "sync s/step": "0.0200", "samples/s vs max_staleness=0": "—"}]
    shares = table_after(proc.stdout, "## Time shares (trace)")
    assert [list(r.values()) for r in shares] == [
        ["hand", "actor", "2", "0.81", "65.4%", "2.5%", "2.5%", "—", "—", "—", "2.5%", "24.7%", "2.5%", "0.0%"],
        ["hand", "learner", "1", "0.50", "—", "—", "—", "60.0%", "8.0%", "10.0%", "8.0%", "10.0%", "—", "4.0%"]]
    assert list(shares[0]) == ["run", "role", "tracks", "wall s", "generate", "score", "push", "train-step", "eval",
                               "checkpoint", "sync", "wait", "other", "untracked"]
    assert [list(r.values()) for r in table_after(proc.stdout, "## Actor idle (trace)")] == [
        ["hand", "actor-0", "0.50", "20.0%"], ["hand", "actor-1", "0.31", "32.3%"]]
    assert_pngs(hand_run / "analysis", "throughput.png", "time_shares.png", "timeline.png")


def test_staleness_of_a_hand_written_run(hand_run):
    proc = script(STALENESS, hand_run)
    assert tables(proc.stdout) == [[{
        "run": "hand", "max_staleness": "2", "steps": "3", "samples": "96", "staleness mean": "0.833",
        "staleness max": "2", "k=0": "33.3%", "k=1": "50.0%", "k=2": "16.7%", "ESS mean": "0.9000",
        "ESS min": "0.8000", "dropped groups": "1"}]]
    assert_pngs(hand_run / "analysis", "staleness_hist.png", "staleness_time.png", "is_ess.png")
