"""`clipdist bench loss`: runs every backend and the open_clip peer, and its figures mean what they say."""

from __future__ import annotations


def test_the_loader_benchmark_reads_clipdist_batches_whole_and_in_pieces(tmp_path):
    """scripts/bench_loader.py's clipdist side (clipdist.tools.loader_rate) runs on the stream as it is (a Batch of more
    fields broke it once)."""
    import importlib.util

    import torchvision.transforms as T
    from fixtures import image_bytes, write_samples
    from helpers import REPO

    from clipdist.model.factory import get_tokenizer

    spec = importlib.util.spec_from_file_location("bench_loader", REPO / "scripts" / "bench_loader.py")
    bench_loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_loader)
    shard = write_samples(
        tmp_path / "0.tar", [{"__key__": str(i), "png": image_bytes(i), "txt": b"x"} for i in range(8)]
    )
    for pieces in (1, 2):
        batches = bench_loader.stream_rows(
            [str(shard)], 4, 0, T.ToTensor(), get_tokenizer(), pixels=False, pieces=pieces
        )
        assert [next(batches), next(batches)] == [4, 4]
        batches.close()


def test_the_training_benchmark_reports_each_pairs_ratio(capsys):
    """scripts/bench_train.py: beside the ratio of the medians, each repeat's ratio (its two runs ran back to back):
    a machine that moves between steady states shows there instead of hiding in one median."""
    import importlib.util
    from types import SimpleNamespace

    from helpers import REPO

    spec = importlib.util.spec_from_file_location("bench_train", REPO / "scripts" / "bench_train.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    run = lambda rate: {"samples_per_s": [1.0] * 2 + [rate] * 5, "wall_s": 1.0, "zeroshot_top1": 0.5}  # noqa: E731
    runs = {("open_clip_train", 1): [run(100), run(80)], ("clipdist", 1): [run(200), run(200)]}
    assert bench.pair_ratios(runs, "clipdist", 1, skip=2) == [2.0, 2.5]
    bench.report(SimpleNamespace(background=0, skip=2, out=None), runs)
    assert "| 1 | clipdist | 200.0 | 2.22 | 2.00, 2.50 | 1 | 0.5 |" in capsys.readouterr().out


def test_the_loss_benchmarks_files_are_checked_before_it_runs(tmp_path, capsys, monkeypatch):
    """--tag names files in --out: a path in it (`../x`) is refused as it is parsed; a file of the same name that
    no benchmark wrote is refused before the benchmark (minutes) runs, not replaced after it."""
    import pytest

    from clipdist.cli import main
    from clipdist.tools import bench

    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("the benchmark ran"))
    for tag in ("../x", "a/b", "-x", "{0..2}"):
        assert main(["bench", "loss", f"--tag={tag}", "--out", str(tmp_path)]) == 2
        assert "a file name's start" in capsys.readouterr().err
    (tmp_path / "loss_cpu.json").write_text("[]")  # an earlier result: replaced
    (tmp_path / "loss_memory_cpu.png").write_text("my own picture")
    assert main(["bench", "loss", "--out", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"--out {tmp_path / 'loss_memory_cpu.png'} exists and is not" in lines[0], lines


def test_the_full_gpu_battery_without_a_gpu_is_one_line(tmp_path, capsys, monkeypatch):
    """Its rows are a GPU's (bf16 L/14 among them): on the CPU it was a KeyError's bug report; --tiny is the CPU's."""
    import torch

    from clipdist.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "gpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device here" in lines[0] and "--tiny" in lines[0], lines
    assert not list(tmp_path.iterdir())
