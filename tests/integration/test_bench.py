"""`clipdist bench loss`: runs every backend and the open_clip peer, and its figures mean what they say."""

from __future__ import annotations

import pytest

from clipdist.tools import bench


@pytest.fixture(scope="module")
def rows():
    return bench.run(
        ["disco", "tiled", "siglip", bench.PEER],
        world_sizes=(2,),
        global_batches=(256, 1024),
        dim=16,
        repeats=1,
        budget_bytes=16e9,
        timeout_s=300,
    )


def by_key(rows):
    return {(r["backend"], r["global_batch"]): r for r in rows}


def test_every_backend_and_the_open_clip_peer_is_measured(rows):
    table = by_key(rows)
    assert set(table) == {(name, batch) for name in ("disco", "tiled", "siglip", bench.PEER) for batch in (256, 1024)}
    for row in rows:
        assert row["kept_bytes"] > 0 and row["seconds"] > 0 and row["world_size"] == 2


def test_over_budget_configurations_are_skipped_with_the_prediction():
    rows = bench.run(
        ["disco"], world_sizes=(1,), global_batches=(4096,), dim=16, repeats=1, budget_bytes=1e6, timeout_s=300
    )
    assert "GB per rank" in rows[0]["skipped"] and "over the 0.001 GB budget" in rows[0]["skipped"]
    assert "kept_bytes" not in rows[0]
    assert "skipped" in bench.markdown(rows, 1, 4096)


def test_the_scaling_table_predicts_what_a_run_keeps(rows):
    """Inf-CL's Table 1 shape comes from the exact fits: at sizes that were run, the prediction is the measurement."""
    table = by_key(rows)
    scaling = bench.scaling(
        bench.loss_fits(["disco", "tiled"]),
        ["disco", "tiled", bench.PEER],
        world_size=2,
        global_batches=(256, 1024),
        dim=16,
    )
    for row in scaling:
        assert row["predicted_kept_bytes"] == pytest.approx(
            table[(row["backend"], row["global_batch"])]["kept_bytes"],
            rel=0.05 if row["backend"] == bench.PEER else 0.01,
        )
        assert row["predicted_peak_bytes"] > row["predicted_kept_bytes"]
    markdown = bench.scaling_markdown(scaling)
    assert "| 256 | 1k |" in markdown and markdown.count("\n| ") == 3


def test_tiled_keeps_linear_memory_and_disco_quadratic(rows):
    table = by_key(rows)
    growth = {name: table[(name, 1024)]["kept_bytes"] / table[(name, 256)]["kept_bytes"] for name in ("disco", "tiled")}
    assert growth["disco"] > 12  # b·B: 4× the batch, ~16× the bytes
    assert growth["tiled"] < 5  # B·d: ~4×
    # open_clip's local loss keeps the same b×B blocks as disco.
    assert table[(bench.PEER, 1024)]["kept_bytes"] == pytest.approx(table[("disco", 1024)]["kept_bytes"], rel=0.05)
