"""The consumer-alone probe's host side (benchmarks/int4_mma_consumer_probe.py), on CPU: its configs and an item's
bytes. The kernel runs on a GPU in the probe."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_configs_parse_into_warps_and_flags():
    from int4_mma_consumer_probe import parse_config

    assert parse_config("4") == {"W": 4, "FLUSH": False, "COUNT": False}
    assert parse_config("4fc") == {"W": 4, "FLUSH": True, "COUNT": True}
    assert parse_config("8f") == {"W": 8, "FLUSH": True, "COUNT": False}
    for bad in ("16", "2", "x"):                     # 16 or 2 warps; not a number
        with pytest.raises(ValueError):
            parse_config(bad)


def test_an_items_bytes_are_its_codes_and_pairs():
    from int4_mma_consumer_probe import KS, item_bytes

    assert item_bytes(4) == 4 * KS * (512 + 64) == 36864
