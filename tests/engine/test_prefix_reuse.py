"""Prefix reuse: a new prompt keeps what the engine's history holds of it (docs/serve.md, "Prefix reuse").

Outputs with reuse are compared with the same prompt prefilled on a fresh history. A history built in
several prefills is not bit-identical to one prefill, so they must be equal or diverge first at a near-tie
of the reference (the engine tests' rule, tests/support/engine.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.engine import Ledger
from clover_dev.convert import clover_convert
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native  # every test here runs the native build (skipped without it; a failure in CI)

MODES = ("ar", "spec", "auto")
LEDGER = Ledger()


@pytest.fixture(scope="module")
def gguf(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(tiny_checkpoint, module_tmp("reuse") / "tiny-f32.gguf", "f32")


@pytest.fixture()
def model(gguf: Path) -> Any:
    from clover_cpp import Model

    with Model(gguf, n_ctx=1024, cache_ram_mib=64, checkpoint_every=0) as m:
        yield m


@pytest.fixture(scope="module")
def fresh(gguf: Path) -> Any:
    from clover_cpp import Model

    with Model(gguf, n_ctx=1024) as m:
        yield m


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 3000, size=n).tolist()


def _solo(fresh: Any, prompt: list[int], mode: str, n: int = 24) -> list[int]:
    fresh.reset()
    return fresh.run(prompt, mode=mode, max_tokens=n, stop_ids=[]).tokens


def _turn(model: Any, prompt: list[int], mode: str, n: int = 24) -> tuple[int, list[int]]:
    reused = model.reuse_prefix(prompt)
    return reused, model.run(prompt[reused:], mode=mode, max_tokens=n, stop_ids=[]).tokens


@pytest.mark.parametrize("mode", MODES)
def test_next_turn_restores_the_checkpoint_where_the_answer_started(model: Any, fresh: Any, tiny_model: Any,
                                                                    mode: str) -> None:
    """Turn 2 re-renders turn 1's answer differently (as Qwen's template drops the reasoning): the history
    goes back to the end of turn 1's prompt and only the rest is prefilled."""
    p1 = _ids(1, 40)
    _, a1 = _turn(model, p1, mode)
    p2 = p1 + a1[5:] + _ids(2, 30)  # the answer, re-rendered without its first tokens, then a new message
    reused, got = _turn(model, p2, mode)
    assert reused == len(p1) - 1  # the checkpoint at the end of turn 1's prefill
    info = model.cache_info()
    assert info.n_restored == 1 and info.checkpoint_bytes > 0
    LEDGER.check(f"reuse/turn2/{mode}", got, _solo(fresh, p2, mode), tiny_model, p2)


@pytest.mark.parametrize("mode", MODES)
def test_a_prompt_that_extends_the_history_prefills_only_the_new_tokens(model: Any, fresh: Any, tiny_model: Any,
                                                                        mode: str) -> None:
    p1 = _ids(3, 33)
    _, a1 = _turn(model, p1, mode)
    p2 = p1 + a1 + _ids(4, 12)
    reused, got = _turn(model, p2, mode)
    assert reused == len(p1) + len(a1) - 1  # everything but the last answer token, which was never committed
    assert model.cache_info().n_restored == 0
    LEDGER.check(f"reuse/extend/{mode}", got, _solo(fresh, p2, mode), tiny_model, p2)


def test_a_prompt_diverging_before_every_checkpoint_starts_fresh(model: Any, fresh: Any, tiny_model: Any) -> None:
    p1 = _ids(5, 50)
    _turn(model, p1, "ar")
    assert model.cache_info().n_checkpoints >= 1
    p2 = p1[:10] + _ids(6, 20)  # diverges at 10, before the only checkpoint (49)
    reused, got = _turn(model, p2, "ar")
    assert reused == 0
    info = model.cache_info()
    assert info.n_restored == 0
    # the checkpoint past the divergence was dropped; p2's prefill checkpointed where it branched off (10)
    # and where it ended
    assert sorted(_checkpoints(model, p2)) == [10, len(p2) - 1]
    LEDGER.check("reuse/diverged", got, _solo(fresh, p2, "ar"), tiny_model, p2)


def _checkpoints(model: Any, prompt: list[int]) -> list[int]:
    """Checkpoint positions, probed through reuse_prefix on prefixes of ``prompt`` (it restores the nearest)."""
    found = set()
    for cut in range(len(prompt) - 1, 1, -1):
        probe = prompt[:cut] + [prompt[cut] + 1 if prompt[cut] < 2999 else 0]
        n = model.reuse_prefix(probe)
        if n == 0:
            break
        found.add(n)
    return sorted(found)


def test_requests_sharing_a_system_prompt_restore_at_their_branch_point(model: Any, fresh: Any,
                                                                         tiny_model: Any) -> None:
    system = _ids(7, 60)
    _turn(model, system + _ids(8, 15), "ar")
    reused_b, _ = _turn(model, system + _ids(9, 15), "ar")  # no checkpoint at 60 yet: fresh, checkpoints at 60
    assert reused_b == 0
    p3 = system + _ids(10, 15)
    reused_c, got = _turn(model, p3, "ar")
    assert reused_c == len(system)
    LEDGER.check("reuse/shared-system", got, _solo(fresh, p3, "ar"), tiny_model, p3)


def test_the_cache_budget_holds(gguf: Path) -> None:
    from clover_cpp import Model

    with Model(gguf, n_ctx=1024) as m:
        m.set_cache(64, checkpoint_every=8)
        m.run(_ids(11, 50), mode="ar", max_tokens=2)
        size = m.cache_info().checkpoint_bytes
        assert m.cache_info().n_checkpoints == 7  # 8, 16, .., 48 and 49 where the answer starts
        m.set_cache(2.5 * size / 2**20, checkpoint_every=8)
        info = m.cache_info()
        assert info.n_checkpoints == 2 and info.n_bytes <= info.max_bytes and info.n_evicted == 5
        m.run(_ids(12, 40), mode="ar", max_tokens=2)
        info = m.cache_info()
        assert info.n_bytes <= info.max_bytes and info.n_checkpoints == 2
        m.set_cache(0)
        assert m.cache_info().n_checkpoints == 0
        with pytest.raises(ValueError):
            m.set_cache(-1)


def test_near_tie_divergences_are_rare() -> None:
    assert LEDGER.compared >= 6
    assert len(LEDGER.near_ties) * 20 <= max(LEDGER.compared, 20), LEDGER.near_ties
