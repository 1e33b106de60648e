"""What updates the weights: the optimizer and its parameter groups (optimizer.py), the lr schedules (schedules.py,
registered in clipdist.registry.schedules) and the weights' running average (ema.py)."""
