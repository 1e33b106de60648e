"""clipdist: CLIP pretraining with exact distributed contrastive losses."""

__version__ = "0.1.0"
