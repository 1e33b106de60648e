"""Hydra entry point for a checkout: python train.py [loss=disco] [world=cpu2] [key=value ...]

From any install, the same is `clipdist train ...` or `python -m clipdist train ...`.
The config groups live in clipdist/conf (conf/ here points there).
"""

from clipdist.cli import train_main

if __name__ == "__main__":
    train_main()
