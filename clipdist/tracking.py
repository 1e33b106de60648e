"""Weights & Biases (offline by default), <run_dir>/train_log.jsonl and <run_dir>/metrics.jsonl."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

class RunTracker:
    """Logs on the main rank only; every other rank gets a tracker that does nothing."""

    def __init__(self, run_dir: Path, mode: str, project: str, name: str, config: dict, enabled: bool):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.run = None
        if enabled and mode != "disabled":
            import wandb

            id_file = Path(run_dir) / "wandb_id"  # same W&B run when the job resumes
            run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
            id_file.write_text(run_id)
            self.run = wandb.init(
                mode=str(mode), project=project, name=name, id=run_id, resume="allow", dir=str(run_dir), config=config,
                settings=wandb.Settings(silent=True, console="off"),
            )

    def log_train(self, stats: dict, step: int) -> None:
        """Training stats: a line in train_log.jsonl, and train/<key> in W&B."""
        self._write("train_log.jsonl", "train", stats, step)

    def log_eval(self, metrics: dict, step: int) -> None:
        """One JSON object per evaluation in metrics.jsonl, and eval/<key> in W&B."""
        self._write("metrics.jsonl", "eval", metrics, step)

    def _write(self, filename: str, section: str, values: dict, step: int) -> None:
        if not self.enabled:
            return
        with open(self.run_dir / filename, "a") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")
        if self.run is not None:
            self.run.log({f"{section}/{key}": value for key, value in values.items()}, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
