"""Loss functions and advantage estimators (see DESIGN.md, "Losses (notation)"), the
registries the config names them by (`LOSSES`, `ADVANTAGES`), and how the learner
turns micro-batch means into global ones (normalization.py, step_metrics.py)."""
