"""Defaults that a config field and the code beneath it share, each stated once; imports nothing, so the config
schema (clipdist.config) reads them without importing torch."""

DEFAULT_MODEL = (
    "clipdist-tiny"  # ~3.4M parameters, 32-px images: trains on a laptop CPU in minutes (conf/model/tiny.yaml)
)
DEFAULT_TILE = 1024  # rows and columns per tile of the ring's pass (loss.tile): the largest transient block is tile²
COLLECTIVE_TIMEOUT_S = 600  # the default bound on one collective, for runs and tools alike (world.timeout_s)
# open_clip's CSV/TSV table (open_clip_train's --csv-separator, --csv-img-key, --csv-caption-key): data.csv_* and
# `clipdist make-shards --csv` read the same tables the same way
TABLE_SEPARATOR, TABLE_IMAGE_KEY, TABLE_CAPTION_KEY = "\t", "filepath", "title"
# Resume rules: what a resume does when a key differs from the checkpoint's (clipdist.config.resume_rule)
REFUSE, WARN, FREE = "refuse", "warn", "free"
