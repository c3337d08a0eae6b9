"""The graph cache (docs/native.md, "Keeping graphs per pass shape"; patch 0008): with it the modes' alternating
pass shapes are built once and then reused, and nothing else changes: the tokens equal those of an engine without
it, bit for bit on the CPU (the same graphs compute the same values)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clover_dev.convert import clover_convert
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native  # every test here runs the native build (skipped without it; a failure in CI)

PROMPT = list(range(40, 72))
MODES = [("ar", {}), ("spec", {"block_size": 4}), ("diffusion", {"block_size": 8, "threshold": 0.006}),
         ("auto", {})]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(tiny_checkpoint, module_tmp("graph-cache") / "tiny-f32.gguf", "f32")


@pytest.mark.parametrize("mode, opts", MODES)
def test_the_cache_reuses_graphs_and_changes_no_token(tiny_gguf: Path, mode: str, opts: dict) -> None:
    from clover_cpp.model import Model

    runs = {}
    for cache in (0, 6):
        with Model(tiny_gguf, n_ctx=512, graph_cache=cache) as model:
            runs[cache] = model.run(PROMPT, mode=mode, max_tokens=48, stop_ids=[], **opts)
    off, on = runs[0], runs[6]
    assert on.tokens == off.tokens
    builds_on = on.stats.passes - on.stats.graph_reuses
    builds_off = off.stats.passes - off.stats.graph_reuses
    if mode != "auto":  # auto's rounds follow measured times: the two engines may draft differently
        assert builds_on <= builds_off
    if mode in ("spec", "diffusion"):  # they alternate shapes: without the cache nearly every pass was built
        assert builds_off >= off.stats.passes // 2, (builds_off, off.stats.passes)
        assert builds_on <= 6, (builds_on, on.stats.passes)  # each shape once (the KV view may add one)
