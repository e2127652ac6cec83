"""A torchrun rank of `async-rl sft`: python -m async_rl.sft RUN_DIR/config.yaml."""
from async_rl.run.offline import rank_main_from_argv
from async_rl.run.processes import exit_now
from async_rl.sft.run import SFT

exit_now(rank_main_from_argv(SFT))
