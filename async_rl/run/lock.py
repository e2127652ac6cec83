"""One writer per run directory: an exclusive lock held for the run's whole life.

`flock` on RUN_DIR/run.lock, taken before anything is written to the directory and
released by the kernel when the holder dies, however it dies (a stale lock file is
never a problem). The holder writes its pid and host into the file, so a second
`train` or `--resume` can name it in its one-line refusal.
"""
from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from async_rl.config import ConfigError

LOCK_FILE = "run.lock"


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None
        self.created = False

    @property
    def fd(self) -> int | None:
        return self._fd

    def acquire(self) -> RunLock:
        """Take the lock or raise ConfigError naming the holder (exit 2)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.created = not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "an unknown process"
            os.close(fd)
            raise ConfigError(f"run_dir: {self.path.parent} is in use by {holder}; wait for that run to end "
                              f"or choose another run_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self, refused: bool = False) -> None:
        """`refused`: the launch stopped before starting anything; a lock file it created
        goes too, so a refused launch leaves the directory as it found it."""
        if refused and self.created and self._fd is not None:
            self.path.unlink(missing_ok=True)
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor of the file description unlocks it
            self._fd = None
