"""Weights & Biases (offline by default) and <run_dir>/metrics.jsonl."""
from __future__ import annotations

import json
from pathlib import Path

WANDB_MODES = ("offline", "online", "disabled")


class RunTracker:
    """Logs on the main rank only; every other rank gets a tracker that does nothing."""

    def __init__(self, run_dir: Path, mode: str, project: str, name: str, config: dict, enabled: bool):
        if mode not in WANDB_MODES:
            raise ValueError(f"logging.wandb={mode!r}; choose one of {', '.join(WANDB_MODES)}")
        self.enabled = enabled
        self.metrics_file = Path(run_dir) / "metrics.jsonl"
        self.run = None
        if enabled and mode != "disabled":
            import wandb

            id_file = Path(run_dir) / "wandb_id"  # same W&B run when the job resumes
            run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
            id_file.write_text(run_id)
            self.run = wandb.init(
                mode=mode, project=project, name=name, id=run_id, resume="allow", dir=str(run_dir), config=config,
                settings=wandb.Settings(silent=True, console="off"),
            )

    def log(self, metrics: dict, step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def log_eval(self, metrics: dict, step: int) -> None:
        """One JSON object per evaluation in metrics.jsonl, and the same under eval/ in W&B."""
        if not self.enabled:
            return
        with open(self.metrics_file, "a") as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")
        self.log({f"eval/{key}": value for key, value in metrics.items()}, step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
