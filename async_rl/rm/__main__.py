"""A torchrun rank of `async-rl rm`: python -m async_rl.rm RUN_DIR/config.yaml."""
from async_rl.rm.run import RM
from async_rl.run.offline import rank_main_from_argv
from async_rl.run.processes import exit_now

exit_now(rank_main_from_argv(RM))
