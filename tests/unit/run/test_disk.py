"""A full disk met by any of the run's writers is one line naming what and where, and the
room set aside at the start lets the run still say so."""
import errno
import json
import os
import subprocess
import sys
import time
from contextlib import suppress

import pytest

from async_rl.run.disk import (
    RESERVED_BYTES,
    RESERVED_FILE,
    DiskFull,
    is_disk_full,
    release_room,
    reserve_room,
    writing,
)
from async_rl.run.metrics import MetricsLogger
from async_rl.run.status import write_status
from async_rl.run.tracing import TraceWriter

DEV_FULL = "/dev/full"  # every write: ENOSPC
pytestmark = pytest.mark.skipif(not os.path.exists(DEV_FULL), reason="needs /dev/full")


def test_a_full_disk_in_a_block_is_one_line_naming_what_and_where(tmp_path):
    with pytest.raises(DiskFull) as caught, writing("metrics", tmp_path / "metrics.jsonl"):
        raise OSError(errno.ENOSPC, "No space left on device")
    message = str(caught.value)
    assert message.startswith(f"the disk is full: metrics {tmp_path / 'metrics.jsonl'} could not be written (")
    assert message.endswith(" MiB free on its file system)") and "\n" not in message and "Errno" not in message
    assert caught.value.errno == errno.ENOSPC and is_disk_full(caught.value)
    with pytest.raises(PermissionError), writing("metrics", tmp_path):  # another error passes as it is
        raise PermissionError(errno.EACCES, "denied")
    wrapped = RuntimeError("a library's own error")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert is_disk_full(wrapped) and not is_disk_full(RuntimeError("other"))


@pytest.mark.parametrize("writer", ["metrics", "samples"])
def test_the_metrics_and_samples_files_name_themselves(tmp_path, writer):
    path = tmp_path / {"metrics": "metrics.jsonl", "samples": "samples.jsonl"}[writer]
    path.symlink_to(DEV_FULL)
    logger = MetricsLogger(tmp_path, total_steps=2)
    try:
        with pytest.raises(DiskFull, match=f"^the disk is full: {writer} {path} could not be written"):
            logger.log({"step": 1, "train/reward_mean": 0.5}, samples=[{"step": 1}])
    finally:
        path.unlink()
        with suppress(DiskFull):  # what the failed write left in the buffer meets the full disk again
            logger.close()


def test_tensorboard_on_a_full_disk_prints_no_thread_traceback_and_names_itself(tmp_path, full_disk, capsys):
    (tmp_path / "tb").symlink_to(full_disk, target_is_directory=True)
    caught = None
    logger = None
    try:
        logger = MetricsLogger(tmp_path, total_steps=100)
        deadline = time.monotonic() + 30
        step = 0
        while caught is None and time.monotonic() < deadline:  # its writer thread fails, our next call says so
            step += 1
            try:
                logger.log({"step": step, "train/reward_mean": 0.5}, texts={"t": "x" * 4096})
            except DiskFull as err:
                caught = err
            time.sleep(0.01)
    except DiskFull as err:  # already at its first write
        caught = err
    assert caught is not None and str(caught).startswith(f"the disk is full: TensorBoard events in {tmp_path / 'tb'}")
    assert "Traceback" not in capsys.readouterr().err
    if logger is not None:
        with pytest.raises(DiskFull):
            logger.close()


def test_the_trace_names_itself(tmp_path):
    (tmp_path / "trace.json.tmp").symlink_to(DEV_FULL)
    writer = TraceWriter(tmp_path / "trace.json")
    with pytest.raises(DiskFull, match=f"^the disk is full: the trace {tmp_path / 'trace.json'} could not"):
        writer.write()


def test_the_room_set_aside_is_what_status_needs_on_a_full_disk(small_disk):
    reserve_room(small_disk)
    assert (small_disk / RESERVED_FILE).stat().st_size == RESERVED_BYTES
    with open(small_disk / "filler", "wb", buffering=0) as out, pytest.raises(OSError):
        while out.write(b"\0" * 4096):
            pass
    with pytest.raises(OSError):
        write_status(small_disk, 1, "x" * 2000)
    release_room(small_disk)
    write_status(small_disk, 1, "the reason")
    assert json.loads((small_disk / "status.json").read_text()) == {"exit_code": 1, "reason": "the reason"}
    release_room(small_disk)  # twice: nothing to do


THREADS = """
import errno, threading
from async_rl.run.disk import quiet_disk_full_in_threads

quiet_disk_full_in_threads()
quiet_disk_full_in_threads()  # once is enough: not wrapped twice


def full():
    raise OSError(errno.ENOSPC, "No space left on device")


def other():
    raise ValueError("a bug")


for target in (full, other):
    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
"""


def test_a_thread_that_dies_of_a_full_disk_prints_nothing():
    out = subprocess.run([sys.executable, "-c", THREADS], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "No space left" not in out.stderr and "ValueError: a bug" in out.stderr
