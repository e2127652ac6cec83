"""A torchrun rank of `async-rl sft`: python -m async_rl.sft RUN_DIR/config.yaml."""
from async_rl.run.processes import exit_now
from async_rl.sft.run import main

exit_now(main())
