"""data.resolution_schedule read once: {global batches trained: value} as stages in order, each key checked."""

from __future__ import annotations


def resolution_stages(schedule) -> list[tuple[int, list[int]]]:
    """[(first batch, its list of values), ...] sorted by first batch; a ValueError names a key that is not a
    global batch number."""
    stages = []
    for step, values in (schedule or {}).items():
        try:
            first = int(step)
        except ValueError:
            raise ValueError(
                f"data.resolution_schedule: {step!r} is not a global batch number (e.g. "
                "+data.resolution_schedule.500=[576])"
            ) from None
        if first < 0:
            raise ValueError(f"data.resolution_schedule: step {first} is before the first (0)")
        stages.append((first, [int(value) for value in values or []]))
    return sorted(stages)
