"""A full disk, whichever of the run's writers meets it first (metrics, TensorBoard,
samples, the trace, checkpoints, final/): one line naming what was being written,
where, and the room left, and room kept to say so.

Every writer of learner rank 0 writes inside `writing(what, path)`, which turns ENOSPC
(or a quota's EDQUOT) into DiskFull, a one-line OSError. TensorBoard writes from a
thread of its own: its failure is not printed there (`quiet_disk_full_in_threads`) but
raised by the writer's next call, on the training thread. At the start of a run rank 0
sets aside RESERVED_BYTES in the run directory (`reserve_room`); a failing run releases
them first (`release_room`), so that status.json and the error log can be written on
a disk that has no byte left.
"""
from __future__ import annotations

import errno
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

RESERVED_FILE = "reserved-room"
RESERVED_BYTES = 64 * 1024  # status.json, the error log with its traceback, the trace's last write
FULL = (errno.ENOSPC, errno.EDQUOT)


def free_mib(path: Path) -> float | None:
    """Room left on the file system holding `path` (its nearest existing folder)."""
    for folder in (path, *path.parents):
        if folder.exists():
            with suppress(OSError):
                return shutil.disk_usage(folder).free / 2**20
            return None
    return None


class DiskFull(OSError):
    """`what` (at `path`) could not be written: no room left on its file system."""

    def __init__(self, what: str, path: Path) -> None:
        free = free_mib(Path(path))
        room = f"{free:.1f} MiB free on its file system" if free is not None else "its file system is full"
        super().__init__(errno.ENOSPC, f"the disk is full: {what} {path} could not be written ({room})")

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 28]"
        return self.strerror


def is_disk_full(err: BaseException | None) -> bool:
    """Whether `err`, or an error it was raised from, says the disk is full."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in FULL:
            return True
        err = err.__cause__ or err.__context__
    return False


@contextmanager
def writing(what: str, path: Path) -> Iterator[None]:
    """Raise DiskFull naming `what` and `path` where the block meets a full disk."""
    try:
        yield
    except DiskFull:
        raise
    except OSError as err:
        if err.errno in FULL:
            raise DiskFull(what, path) from err
        raise


def reserve_room(run_dir: Path) -> None:
    """Set RESERVED_BYTES aside in the run directory (best effort: a disk that has not
    that much left keeps what it has, for the run)."""
    path = Path(run_dir) / RESERVED_FILE
    try:
        path.write_bytes(b"\0" * RESERVED_BYTES)
    except OSError:
        release_room(run_dir)


def release_room(run_dir: Path) -> None:
    with suppress(OSError):
        (Path(run_dir) / RESERVED_FILE).unlink(missing_ok=True)


def quiet_disk_full_in_threads() -> None:
    """A thread that dies of a full disk prints no traceback: the writer it served
    raises the error on its owner's thread, where it becomes the run's one line."""
    previous = threading.excepthook
    if getattr(previous, "quiet_disk_full", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not is_disk_full(args.exc_value):
            previous(args)

    hook.quiet_disk_full = True  # type: ignore[attr-defined]
    threading.excepthook = hook
