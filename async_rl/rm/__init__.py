"""Training a reward model on preference pairs (`async-rl rm`): the run's model with a
scalar head, trained with the Bradley-Terry loss by the learner's own parts (FSDP2,
precision, LoRA, ranks under torchrun), written as a Hugging Face sequence-classification
model a `reward_model` component scores with. pairs.py: from rows to tokens; trainer.py:
the loss and the steps; run.py: the command."""
