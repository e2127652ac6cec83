"""The evaluator: a process beside learner rank 0 that scores the held-out prompts on
saved policy versions (eval.placement=evaluator), so that neither a learner step nor a
weight sync ever waits for an evaluation round.

    learner rank 0 --(versions.py: the weights of version v, written at an eval step)--> RUN_DIR/evaluator/
    evaluator (service.py) --(the round's metrics line, stamped with version v's time)--> the same folder
    learner rank 0: logs each line at step v (process.py starts, restarts and stops the evaluator)
"""
