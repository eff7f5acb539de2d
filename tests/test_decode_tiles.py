"""``benchmarks/decode_tiles.py --tiles``: a tiling's key read back as the tiles it names."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.decode_tiles import candidates, key, parse_key
from splitserve.kernels.tuning import DecodeTiles, FP8DecodeTiles


def test_every_swept_tiling_reads_back_from_its_key():
    for tiles in candidates("fp8", quick=False) + candidates("bf16", quick=False):
        assert parse_key(key(tiles)) == tiles
    assert parse_key("n128/s1/w2/f16") == DecodeTiles(128, 1, 2, fp8_f16_dot=True)
    assert parse_key("cuda/w8/s2/b2") == FP8DecodeTiles(8, 2, 2.0)  # the CUDA kernel's


@pytest.mark.parametrize("bad", ["n128/s1", "x128/s1/w2", "n128/s1/w2/bf16", "nA/s1/w2", ""])
def test_a_malformed_key_says_what_is_expected(bad):
    with pytest.raises(argparse.ArgumentTypeError, match=r"n<tokens>/s<stages>/w<warps>\[/f16\]"):
        parse_key(bad)
