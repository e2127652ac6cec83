"""Damaged checkpoints: the manifest written last detects truncated, deleted, garbled or
bit-rotted files; fall-back and rotation keep the newest intact checkpoint; strict
readers and the slot-partition check never let a resumed run lose a buffered group.
(`--resume` on real runs: tests/integration/test_resume_damaged_checkpoints.py.)"""
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import torch
import torch.distributed as dist
from conftest import flip_one_bit, truncate_half

from async_rl.learner.checkpoint import (
    BUFFER_FILE,
    STATE_FILE,
    load_checkpoint,
    read_groups,
    save_checkpoint,
    write_groups,
)
from async_rl.run.checkpoints import (
    MANIFEST,
    CheckpointError,
    check_partition,
    complete_checkpoints,
    latest_checkpoint,
    latest_intact_checkpoint,
    verify_checkpoint,
    write_manifest,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _group(seed=0):
    from wire_samples import make_group

    return make_group(seed=seed)


def _fake_checkpoint(path: Path) -> Path:
    """A directory shaped like a checkpoint (DCP's file names), with a manifest."""
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (path / ".metadata").write_bytes(b"dcp metadata" * 10)
    write_groups(path / BUFFER_FILE, [(3, 1, _group())])
    (path / "config.yaml").write_text("seed: 0\n")
    (path / STATE_FILE).write_text(json.dumps({"version": 2}))
    (path / "sub").mkdir()
    (path / "sub" / "nested.bin").write_bytes(b"x" * 10)
    write_manifest(path)
    return path


def test_manifest_round_trip(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "step_000002")
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", BUFFER_FILE, "config.yaml", STATE_FILE, "sub/nested.bin"]
    assert files["__0_0.distcp"]["size"] == 256 * 40
    assert verify_checkpoint(ckpt) is None


DAMAGE = {
    "truncated shard": (lambda c: truncate_half(c / "__0_0.distcp"),
                        "shard __0_0.distcp: 5120 bytes, manifest says 10240"),
    "deleted shard": (lambda c: (c / "__0_0.distcp").unlink(), "missing file __0_0.distcp"),
    "deleted .metadata": (lambda c: (c / ".metadata").unlink(), "missing file .metadata"),
    "garbled coordinator.json": (lambda c: (c / STATE_FILE).write_text('{"version": 9}'), "coordinator.json: checksum"),
    "bit-rot": (lambda c: flip_one_bit(c / BUFFER_FILE), "buffer.msgpack: checksum mismatch"),
    "stray file": (lambda c: (c / "notes.txt").write_text("hi"), "extra file notes.txt"),
    "deleted manifest": (lambda c: (c / MANIFEST).unlink(), "missing manifest"),
    "garbled manifest": (lambda c: (c / MANIFEST).write_text("{not json"), "manifest.json: unreadable"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_each_kind_of_damage_is_detected(tmp_path, kind):
    ckpt = _fake_checkpoint(tmp_path / "step_000002")
    damage, reason = DAMAGE[kind]
    damage(ckpt)
    got = verify_checkpoint(ckpt)
    assert got is not None and got.startswith(reason), got
    assert "\n" not in got


def test_read_groups_refuses_a_truncated_or_garbled_file(tmp_path):
    path = tmp_path / BUFFER_FILE
    write_groups(path, [(i, 1, _group(seed=i)) for i in range(4)])
    assert [i for i, _, _ in read_groups(path)] == [0, 1, 2, 3]
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) - 7])  # the unpacker alone would return 3 records
    with pytest.raises(CheckpointError, match="truncated after 3 records"):
        read_groups(path)
    path.write_bytes(whole + msgpack.packb("not a record"))
    with pytest.raises(CheckpointError, match="record 4 is not"):
        read_groups(path)
    path.write_bytes(b"\xc1" + whole)  # 0xc1: never used by msgpack
    with pytest.raises(CheckpointError, match="garbled"):
        read_groups(path)
    path.unlink()
    with pytest.raises(CheckpointError, match="unreadable"):
        read_groups(path)
    path.write_bytes(b"")
    assert read_groups(path) == []  # an empty buffer is a valid one


def _snapshot(**changes):
    """Slots 0..11: 0-4 consumed, 5 dropped, 6 skipped below buffer_next 8, 7 buffered but
    not yet taken; from 8: 8 and 10 buffered, 9 pending, 11 skipped."""
    state = {"admitted": 12, "buffer_next": 8, "consumed": 5, "dropped": 1, "skipped": [6, 11], "pending": [9],
             "next_actor_id": 2, "rejected": {}}
    buffered = changes.pop("buffered", [7, 8, 10])
    return {**state, **changes}, buffered


@pytest.mark.parametrize("changes, error", [
    ({}, None),
    ({"pending": []}, "admitted slot 9 is neither buffered, pending nor skipped"),  # a hole
    ({"buffered": [7, 8, 9, 10]}, "slot 9 is held twice"),
    ({"buffered": [7, 8, 10, 10]}, "slot 10 is held twice"),
    ({"pending": [9, 12]}, "pending slot 12 is not an admitted slot"),
    ({"buffered": [-1, 7, 8, 10]}, "buffered slot -1 is not an admitted slot"),
    ({"buffered": [8, 10]}, "slots below buffer_next 8 are neither buffered nor skipped, but consumed + dropped = 6"),
    ({"pending": [4, 9]}, "pending slot 4 is below buffer_next"),
    ({"buffer_next": 13}, "buffer_next 13 outside"),
    ({"admitted": "x"}, "malformed"),
])
def test_partition_check(changes, error):
    state, buffered = _snapshot(**changes)
    if error is None:
        check_partition(state, buffered)
        return
    with pytest.raises(CheckpointError, match=re.escape(error)):
        check_partition(state, buffered)


def test_coordinator_restore_refuses_a_snapshot_with_a_hole():
    from async_rl.coordinator.coordinator import Coordinator

    state, _ = _snapshot()
    untouched = SimpleNamespace()  # the check comes first: nothing of the coordinator is set
    with pytest.raises(CheckpointError, match="7 slots below buffer_next 8 are neither buffered nor skipped"):
        Coordinator.restore(untouched, 3, state, [(8, 1, None), (10, 1, None)])
    assert vars(untouched) == {}


# -- save_checkpoint in a one-process gloo world --------------------------------------

@pytest.fixture
def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # so the optimizer has state to save
    yield {"model": (model, optimizer)}
    dist.destroy_process_group()


def _save(run: Path, step: int, parts, keep=None, **changes):
    state, buffered = _snapshot(**changes)
    groups = [(i, 1, _group(seed=i)) for i in buffered]

    def write_extra(directory: Path) -> None:
        write_groups(directory / BUFFER_FILE, groups)
        (directory / "config.yaml").write_text("seed: 0\n")

    save_checkpoint(run / "checkpoints" / f"step_{step:06d}", parts, {"version": step, "coordinator": state},
                    write_extra, keep=keep)
    return run / "checkpoints" / f"step_{step:06d}"


def test_save_writes_a_verified_manifest_and_loads_back(tmp_path, world):
    ckpt = _save(tmp_path, 2, world)
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert {".metadata", BUFFER_FILE, "config.yaml", STATE_FILE} <= files.keys()
    assert any(name.endswith(".distcp") for name in files)
    assert verify_checkpoint(ckpt) is None and latest_checkpoint(tmp_path) == ckpt
    model, optimizer = world["model"]
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    assert load_checkpoint(ckpt, world)["version"] == 2
    assert torch.equal(model.weight, saved)
    (ckpt / STATE_FILE).write_text("{garbled")
    with pytest.raises(CheckpointError, match="coordinator.json: unreadable"):
        load_checkpoint(ckpt, world)


def test_save_refuses_a_snapshot_with_a_hole(tmp_path, world):
    good = _save(tmp_path, 2, world)
    with pytest.raises(CheckpointError, match="admitted slot 9 is neither"):
        _save(tmp_path, 4, world, keep=1, pending=[])
    assert complete_checkpoints(tmp_path / "checkpoints") == [good]  # nothing committed, nothing rotated away
    assert verify_checkpoint(good) is None


def test_fall_back_sets_damaged_ones_aside_and_rotation_keeps_the_verified_one(tmp_path, world):
    for step in (2, 4, 6):
        _save(tmp_path, step, world)
    checkpoints = tmp_path / "checkpoints"
    truncate_half(checkpoints / "step_000006" / BUFFER_FILE)
    (checkpoints / "step_000004" / MANIFEST).unlink()
    warnings = []
    found, damaged = latest_intact_checkpoint(tmp_path, warnings.append)
    assert found == checkpoints / "step_000002"
    assert damaged[0].startswith("step_000006: buffer.msgpack: ") and "manifest says" in damaged[0]
    assert damaged[1:] == ["step_000004: missing manifest"]
    assert len(warnings) == 2 and warnings[0].startswith("checkpoint step_000006 is damaged (buffer.msgpack")
    assert warnings[0].endswith("kept as step_000006.damaged; resuming from an earlier one")
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["step_000002", "step_000004.damaged", "step_000006.damaged"]

    # keep=1: the new checkpoint is committed (and verified) before the older one goes;
    # the .damaged evidence is neither counted nor deleted.
    new = _save(tmp_path, 4, world, keep=1)
    assert verify_checkpoint(new) is None
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000004", "step_000004.damaged",
                                                             "step_000006.damaged"]
    # A newer committed directory (another run's leftovers, say) never makes rotation
    # delete the checkpoint just written.
    shutil.copytree(new, checkpoints / "step_000009")
    newest = _save(tmp_path, 6, world, keep=1)
    assert newest.exists() and verify_checkpoint(newest) is None


def test_nothing_is_renamed_when_no_checkpoint_is_intact(tmp_path, world):
    for step in (2, 4):
        _save(tmp_path, step, world)
    for ckpt in complete_checkpoints(tmp_path / "checkpoints"):
        flip_one_bit(ckpt / STATE_FILE)
    warnings = []
    assert latest_intact_checkpoint(tmp_path, warnings.append) == (
        None, ["step_000004: coordinator.json: checksum mismatch", "step_000002: coordinator.json: checksum mismatch"])
    assert warnings == [] and len(complete_checkpoints(tmp_path / "checkpoints")) == 2


def test_a_full_disk_is_one_line_naming_the_checkpoint_and_nothing_is_committed(small_disk):
    """DCP's own error is a BaseException carrying every rank's traceback: the learner
    gets a CheckpointError (an Exception) of one line naming the checkpoint and the cause."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(256, 512)  # 0.5 MiB of weights: more than the disk holds
        optimizer = torch.optim.Adam(model.parameters())
        path = small_disk / "checkpoints" / "step_000002"
        with pytest.raises(CheckpointError) as caught:
            save_checkpoint(path, {"model": (model, optimizer)}, {"version": 2})
    finally:
        dist.destroy_process_group()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"checkpoint {path}: ")
    assert re.search(r"its file system has 0\.\d MiB free, the checkpoint needs about 1\.5 MiB\)$", message), message
    assert list((small_disk / "checkpoints").iterdir()) == []  # the partial one removed: room for status.json
