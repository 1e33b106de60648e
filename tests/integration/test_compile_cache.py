"""torch.compile's caches live beside the run: a resumed (or requeued) start finds its graphs compiled already.
On this CPU with inductor, as on a GPU: the second start adds no file to the cache and its first step is the cache's
read, not a compile (measured in docs/training.md). What the cache holds runs, so only what this user's clipdist
signed is kept: a module changed or added since the last save is removed before torch imports it."""

from __future__ import annotations

import json

from helpers import train

from clipdist.model.factory import resolve_model_name
from clipdist.tools.gpu_battery import first_step_seconds

COMPILED = ("model.compile=true", "data.workers=0", "eval_every=1000")


def one_layer_model(folder) -> str:
    """clipdist-tiny with one block a tower: its cold compile ~16 s shorter on 2 cores (the cache works alike)."""
    import open_clip

    config = open_clip.get_model_config(resolve_model_name("clipdist-tiny"))
    config["vision_cfg"]["layers"] = config["text_cfg"]["layers"] = 1
    path = folder / "one-layer-tiny.json"
    path.write_text(json.dumps(config))
    return f"model.name={path}"


def cached_files(run_dir):
    return {path.relative_to(run_dir) for path in (run_dir / "compile_cache").rglob("*") if path.is_file()}


def test_a_second_start_reuses_the_compile_beside_the_run_and_runs_nothing_unsigned(tmp_path, cache_dir):
    run_dir, model = tmp_path / "run", one_layer_model(tmp_path)
    own_key = {"XDG_CONFIG_HOME": str(tmp_path / "config")}  # this test's user key, not the machine user's
    first = train(run_dir, cache_dir, *COMPILED, model, "optim.max_steps=2", env=own_key, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"torch.compile on (model.compile=true); its caches in {run_dir / 'compile_cache'}" in first.stdout
    compiled = cached_files(run_dir)
    assert any("fxgraph" in str(path) for path in compiled), sorted(compiled)[:20]  # inductor's graphs, here
    marker = tmp_path / "ran"
    modules = sorted((run_dir / "compile_cache").rglob("*.py"))
    assert modules, sorted(compiled)[:20]
    for module in modules:  # as someone who handed the run folder over could have left it
        module.write_text(f"import pathlib; pathlib.Path({str(marker)!r}).touch()\n" + module.read_text())
    (run_dir / "compile_cache" / "stray.py").write_text("print('not torch')")
    second = train(run_dir, cache_dir, *COMPILED, model, "optim.max_steps=4", env=own_key, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step 3: " in second.stdout, second.stdout[-2000:]
    assert not marker.exists()
    assert f"compile cache: {len(modules) + 1} file(s) not signed by this user's clipdist removed" in second.stderr
    assert cached_files(run_dir) == compiled  # every graph found in the cache (modules rewritten from them)
    cold, warm = first_step_seconds(first.stdout), first_step_seconds(second.stdout)  # as the GPU battery reads them
    assert warm < cold / 2, (cold, warm)  # read, not compiled (26 s and 1.7 s here)
