"""Supervised warm start on demonstrations (`async-rl sft`): the run's own model and
learner (FSDP2, LoRA, precision) trained on conversations, loss on the assistant's
tokens laid out as the run's episodes are, written as a model `async-rl train` starts
from. conversations.py: from rows to tokens; trainer.py: the steps; run.py: the command."""
