"""Rewards: what a call of a reward comes to (`outcome`), and the worker processes the
task's reward runs in (`pool`, `worker`, `frames`), where a call past its deadline can
be stopped."""
