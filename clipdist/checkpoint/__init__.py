"""Checkpoints and the run directory: the checkpointer (manager), the safe readers of weights and checkpoints
(weights), the train state, remote copies, the run directory and its lock."""
