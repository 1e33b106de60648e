"""The towers from config: open_clip's factory and timm towers, NaFlex inputs, short text, precision, and what a user
names as a model (targets)."""
