"""What one sandboxed run may use."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. LocalSandbox enforces all of them (`disk_mb` only with
    namespaces, where the run's writable space is a tmpfs of that size); HttpSandbox
    sends the time and memory limits and caps the output it returns."""

    timeout_s: float = 10.0  # wall clock, from the run's start to its end, start-up included
    cpu_s: float = 10.0  # CPU seconds of each process (RLIMIT_CPU), rounded up to whole seconds
    memory_mb: int = 1024  # address space of each process (RLIMIT_AS)
    max_processes: int = 32  # processes and threads of the run's user (RLIMIT_NPROC)
    file_size_mb: int = 16  # the largest file it may write (RLIMIT_FSIZE)
    open_files: int = 64  # file descriptors of each process (RLIMIT_NOFILE)
    output_bytes: int = 1 << 20  # stdout and stderr together; beyond it the run is stopped (output_limit)
    disk_mb: int = 64  # its writable space: the run directory and /tmp (namespaces only)

    def __post_init__(self) -> None:
        for field in fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"SandboxLimits.{field.name} must be positive, got {getattr(self, field.name)!r}")
