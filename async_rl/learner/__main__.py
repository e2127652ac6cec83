"""The learner's process entry point: `torchrun ... -m async_rl.learner RUN_DIR/config.yaml [--resume CHECKPOINT]`."""
from async_rl.learner.process import main
from async_rl.run.processes import exit_now

exit_now(main())
