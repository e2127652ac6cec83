"""Loss functions and advantage estimators (notation and formulas: docs/algorithms.md), the
registries the config names them by (`LOSSES`, `ADVANTAGES`), and how the learner
turns micro-batch means into global ones (normalization.py, step_metrics.py)."""
