import sys
from pathlib import Path

from async_rl.evaluator.versions import mark_progress_while_starting

starting = mark_progress_while_starting(Path(sys.argv[1]))  # before torch loads, which takes seconds

from async_rl.evaluator.service import main  # noqa: E402

sys.exit(main(ready=starting))
