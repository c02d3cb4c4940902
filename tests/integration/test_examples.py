"""The guides' examples in examples/ run, and train as the same loop without the cache does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("nested", [False, True], ids=["dict batches", "nested tuple batches"])
@pytest.mark.slow
def test_text_pairs_match_the_plain_loop(daemon, monkeypatch, nested):
    monkeypatch.setenv("ACTCACHE_SOCKET", str(daemon.socket))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import text_pairs

    try:
        losses, hits = text_pairs.train(cached=True, nested=nested)
        # epoch 1 computed and stored the 32 pairs' prefix, epoch 2 was served; both epochs were when the
        # other batch form ran first on this daemon: the same data and weights give the same keys
        assert hits in (32, 64)
        assert losses == text_pairs.train(cached=False, nested=nested)[0]
    finally:
        sys.modules.pop("text_pairs", None)


def test_dict_batches_with_inputs_match_the_plain_loop(daemon, monkeypatch):
    monkeypatch.setenv("ACTCACHE_SOCKET", str(daemon.socket))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import dict_batches

    try:
        losses, hits = dict_batches.train(cached=True)
        assert hits == 64  # epoch 1 computed and stored the 64 images' prefix, epoch 2 was served
        assert losses == dict_batches.train(cached=False)[0]
    finally:
        sys.modules.pop("dict_batches", None)
