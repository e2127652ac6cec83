import json

import torch

from async_rl.evaluator.versions import VersionStore, load_version, unscored, version_file, write_atomically


def params():
    return [("b.weight", torch.arange(6.0).reshape(2, 3)), ("a.bias", torch.tensor([1.5, -2.25]))]


def test_a_saved_version_loads_in_gather_order_in_the_store_dtype(tmp_path):
    store = VersionStore(tmp_path, "seed: 0\n", torch.bfloat16)
    live = params()
    store.saver(10, 12.5)(iter(live))
    live[0][1].add_(100.0)  # training goes on: the saved copy must not follow
    store.flush()
    assert unscored(tmp_path) == [10] and store.pending == {10}
    meta, tensors = load_version(tmp_path, 10)
    assert meta == {"version": 10, "time": 12.5, "names": ["b.weight", "a.bias"]}
    assert [t.dtype for t in tensors] == [torch.bfloat16] * 2
    assert torch.equal(tensors[0], torch.arange(6.0).reshape(2, 3).bfloat16())
    assert torch.equal(tensors[1], torch.tensor([1.5, -2.25]).bfloat16())
    assert (tmp_path / "config.yaml").read_text() == "seed: 0\n"


def test_results_come_oldest_first_and_take_their_version_files_with_them(tmp_path):
    store = VersionStore(tmp_path, "", torch.float32)
    for version in (20, 10):
        store.saver(version, float(version))(iter(params()))
    store.flush()
    write_atomically(version_file(tmp_path, 20, ".result.json"), json.dumps({"step": 20}))
    assert unscored(tmp_path) == [10]
    write_atomically(version_file(tmp_path, 10, ".result.json"), json.dumps({"step": 10}))
    assert [line["step"] for line in store.results()] == [10, 20]
    assert store.pending == set() and list(tmp_path.glob("v*")) == [] and store.results() == []


def test_a_resumed_run_drops_what_the_stopped_run_saved_past_its_checkpoint(tmp_path):
    store = VersionStore(tmp_path, "", torch.float32)
    for version in (10, 20):
        store.saver(version, 0.0)(iter(params()))
    store.flush()
    resumed = VersionStore(tmp_path, "", torch.float32, resumed_at=15)
    assert resumed.pending == {10} and unscored(tmp_path) == [10]
    assert VersionStore(tmp_path, "", torch.float32).pending == set()  # a fresh run starts empty


def test_a_save_that_fails_is_reported_not_raised(tmp_path):
    store = VersionStore(tmp_path, "", torch.float32)
    (tmp_path / "v000010.safetensors.tmp").mkdir()  # the writer's temporary file cannot be created
    store.saver(10, 0.0)(iter(params()))
    store.flush()
    assert store.error is not None and store.pending == set() and unscored(tmp_path) == []


def test_a_starting_evaluator_marks_progress_until_it_is_ready(tmp_path):
    import os
    import threading
    import time

    from async_rl.evaluator.versions import PROGRESS_FILE, STARTUP_MARK_S, mark_progress_while_starting

    progress = tmp_path / PROGRESS_FILE
    ready = mark_progress_while_starting(tmp_path)
    deadline = time.monotonic() + 30
    while not progress.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.utime(progress, (0, 0))  # made long ago: the next mark must renew it
    while progress.stat().st_mtime == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert progress.stat().st_mtime > 0
    ready.set()
    for thread in threading.enumerate():
        if thread.name == "evaluator-starting":
            thread.join(timeout=30)
    os.utime(progress, (0, 0))
    time.sleep(2 * STARTUP_MARK_S)
    assert progress.stat().st_mtime == 0  # ready: from now on chunks and lines are the progress
