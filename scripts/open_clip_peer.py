"""open_clip's own trainer (open_clip_train, shipped in the open_clip_torch wheel) with the shims it needs to
run clipdist's benchmark workload: `python scripts/open_clip_peer.py <open_clip_train arguments>`.

- clipdist's model configs (clipdist-tiny, ...) are registered with open_clip, so both trainers build the
  same towers from the same config; `--model path/to/config.json` is registered and named by its stem;
- open_clip_train's `group_by_keys_nothrow` reads webdataset 1.0's end-of-shard marker `{}` as a file and
  fails with KeyError 'fname': the marker is dropped before it;
- it wraps the model in DDP with `device_ids=[cpu]` on CPU, which torch refuses ("device_ids ... only work
  with ... GPU modules"): CPU device ids are dropped.
open_clip_train also needs pandas, which open_clip_torch does not install.
"""

from __future__ import annotations

import sys


def _ddp_without_cpu_device_ids():
    import torch

    ddp = torch.nn.parallel.DistributedDataParallel

    class CpuFriendlyDDP(ddp):
        def __init__(self, module, device_ids=None, **kwargs):
            if device_ids and all(torch.device(device).type == "cpu" for device in device_ids):
                device_ids = None
            super().__init__(module, device_ids=device_ids, **kwargs)

    torch.nn.parallel.DistributedDataParallel = CpuFriendlyDDP


def patch_open_clip_data():
    """open_clip_train.data, its grouping made to skip webdataset 1.0's end-of-shard marker (once)."""
    import open_clip_train.data as open_clip_data

    group = open_clip_data.group_by_keys_nothrow
    if not getattr(group, "skips_end_marker", False):

        def grouped(files, *args, **kwargs):
            return group((f for f in files if f), *args, **kwargs)

        grouped.skips_end_marker = True
        open_clip_data.group_by_keys_nothrow = grouped
    return open_clip_data


def main(argv: list[str]) -> None:
    from open_clip_train.main import main as open_clip_main

    from clipdist.model.factory import _register_model_configs, resolve_model_name

    _register_model_configs()
    if "--model" in argv:
        at = argv.index("--model") + 1
        argv = [*argv[:at], resolve_model_name(argv[at]), *argv[at + 1 :]]
    _ddp_without_cpu_device_ids()
    patch_open_clip_data()
    open_clip_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
