"""Scoring a saved model outside a run (`async-rl eval`), as a run's actors score their
evaluation rounds."""
