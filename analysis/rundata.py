"""The run-directory reader under its older name, for code that still imports it from
here: it lives in the package, async_rl/run_dir.py."""
from async_rl.run_dir import Run, RunDir, TraceSpan, load_run, read_trace

__all__ = ["Run", "RunDir", "TraceSpan", "load_run", "read_trace"]
