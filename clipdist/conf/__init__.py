"""Hydra config groups shipped with clipdist (a package so Hydra finds them from any install)."""
