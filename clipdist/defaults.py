"""Defaults that a config field and the code beneath it share, each stated once, and the field helpers that carry a
default with its bound; imports nothing but dataclasses, so the config schema (clipdist.config) and the registries'
option dataclasses read them without importing torch."""

from dataclasses import field

DEFAULT_MODEL = (
    "clipdist-tiny"  # ~3.4M parameters, 32-px images: trains on a laptop CPU in minutes (conf/model/tiny.yaml)
)
DEFAULT_TILE = 1024  # rows and columns per tile of the ring's pass (loss.tile): the largest transient block is tile²
COLLECTIVE_TIMEOUT_S = 600  # the default bound on one collective, for runs and tools alike (world.timeout_s)
# open_clip's CSV/TSV table (open_clip_train's --csv-separator, --csv-img-key, --csv-caption-key): data.table.* and
# `clipdist make-shards --csv` read the same tables the same way
TABLE_SEPARATOR, TABLE_IMAGE_KEY, TABLE_CAPTION_KEY = "\t", "filepath", "title"
# Resume rules: what a resume does when a key differs from the checkpoint's (clipdist.config.resume_rule)
REFUSE, WARN, FREE = "refuse", "warn", "free"


def _bounded(default, low: float, strict: bool, says: str, high: float | None = None):
    """A field whose value validate holds to `low` (above it where `strict`) and to at most `high`; a field that
    defaults to None (automatic, or off) may also be null, and its message says so."""
    says += " (or null)" if default is None else ""
    return field(default=default, metadata={"bound": (low, strict, says), "high": high})


def positive(default):
    """A field that must be at least 1."""
    return _bounded(default, 1, False, "at least 1")


def non_negative(default):
    """A field that must be 0 or more."""
    return _bounded(default, 0, False, "0 or more")


MAX_SEED = 2**32 - 1  # what every generator a seed reaches takes (NumPy's legacy seed is 32-bit)


def seed_field(default):
    """A seed: 0 to MAX_SEED."""
    return _bounded(default, 0, False, f"from 0 to {MAX_SEED}", high=MAX_SEED)


def above_zero(default):
    """A field that must be above 0."""
    return _bounded(default, 0, True, "above 0")
