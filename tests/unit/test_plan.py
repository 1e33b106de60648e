"""`clipdist plan`: memory predicted from small measurements matches a real step's, within 20%."""
from __future__ import annotations

import pytest

from clipdist.tools import plan

BACKENDS = ["disco", "tiled", "siglip"]


def test_parse_bytes_and_presets():
    assert plan.parse_bytes("40GB") == 40 * 10**9
    assert plan.parse_bytes("80GiB") == 80 * 2**30
    assert plan.parse_bytes("512M") == 512 * 10**6
    assert plan.parse_bytes("A100-40GB") == 40 * 10**9
    with pytest.raises(ValueError, match="40GB"):
        plan.parse_bytes("lots")
    assert plan.resolve_world("64gpu") == (64, 8) and plan.resolve_world("3") == (3, 3)
    assert plan.resolve_model("vit_b32") == ("ViT-B-32", False)
    with pytest.raises(ValueError, match="64gpu"):
        plan.resolve_world("65gpu")
