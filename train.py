"""Hydra entry point: python train.py [loss=disco] [world=cpu2] [key=value ...]"""
import logging

import hydra

from clipdist.config import register

register()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg) -> None:
    from clipdist.train import run

    logging.getLogger().setLevel(logging.WARNING)  # open_clip's factory chatter
    logging.getLogger("clipdist").setLevel(logging.INFO)
    run(cfg)


if __name__ == "__main__":
    main()
