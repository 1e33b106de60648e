"""The training loop and what it calls: the trainer, one step, the optimizer and schedule, evaluation, tracking (W&B,
TensorBoard, jsonl logs), the recipe said back."""
