"""Slots (docs/serve.md, "Slots"): several generations on one context, their passes batched into shared
llama_decode rounds. Each slot's output must equal what the same calls give on a single-slot engine (greedy;
the near-tie rule of the engine tests), and the passes must really have been batched."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine import Ledger, run_concurrently
from clover_dev.convert import clover_convert
from tests.support.tmp import MkTemp

# (mode, options): every decoding mode, two slots in ar so that same-size passes meet in a round
CASES = [("ar", {}), ("ar", {}), ("diffusion", {"block_size": 8, "threshold": 0.006}), ("spec", {"block_size": 8}),
         ("auto", {})]
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Point:\n    def __init__(self, x, y):\n",
           "for i in range(10):\n", "# sort a list\n"]
FOLLOW_UPS = ["\n# now the tests\n", "\ndef main():\n", "\n    def norm(self):\n", "\nprint('done')\n", "\nx = 1\n"]


class Overlap:
    """Makes two slots' generations overlap. A tiny model's answer takes milliseconds, so two threads started
    together need not meet in a round at all on a loaded machine. Slot 0 holds its first tokens' callback, which
    the engine runs outside the shared lock with the slot still counted as generating, until slot 1 is about to
    generate, and half a second longer so that slot 1 is inside the engine before slot 0's next pass."""

    def __init__(self) -> None:
        self.first_started = threading.Event()
        self.second_starting = threading.Event()

    def first_tokens(self, _: list[int]) -> bool:
        if not self.second_starting.is_set():
            self.first_started.set()
            assert self.second_starting.wait(60), "slot 1 did not start"
            time.sleep(0.5)
        return True

    def second_starts(self) -> None:
        assert self.first_started.wait(60), "slot 0 did not start"
        self.second_starting.set()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(tiny_checkpoint, module_tmp("slots") / "tiny-f32.gguf", "f32")


def _conversation(model: Any, i: int) -> list[tuple[list[int], list[int]]]:
    """Two turns on one slot: a prompt, then a follow-up continuing the same history. (context, tokens) per turn."""
    mode, opts = CASES[i]
    model.reset()
    turns = []
    context: list[int] = []
    for text in (PROMPTS[i], FOLLOW_UPS[i]):
        ids = model.tokenize(text)
        context += ids
        got = list(model.run(ids, mode=mode, max_tokens=24, stop_ids=[], **opts).tokens)
        turns.append((list(context), got))
        context += got
    return turns


@pytest.mark.native
def test_slots_equal_their_solo_runs_and_batch_their_passes(tiny_gguf: Path, tiny_model: Any) -> None:
    from clover_cpp.model import Model

    with Model(tiny_gguf, n_ctx=1024) as solo:
        want = [_conversation(solo, i) for i in range(len(CASES))]
        assert solo.n_parallel == 1 and solo.pass_stats() == (0, 0)

    with Model(tiny_gguf, n_ctx=1024 * len(CASES), n_parallel=len(CASES)) as model:
        assert model.n_parallel == len(CASES) and model.n_ctx == 1024  # -c is divided among the slots
        got = run_concurrently(lambda i: _conversation(model.slot(i), i), len(CASES))
        passes, rounds = model.pass_stats()

    ledger = Ledger()
    for i, (mode, _) in enumerate(CASES):
        assert not isinstance(got[i], BaseException), f"slot {i} ({mode}): {got[i]!r}"
        for turn, ((_, toks), (context, want_toks)) in enumerate(zip(got[i], want[i])):
            ledger.check(f"slot{i}/{mode}/turn{turn}", toks, want_toks, tiny_model, context)
            if toks != want_toks:  # diverged at a near-tie: the follow-up continues a different history
                break
    assert len(ledger.near_ties) <= 1, ledger.near_ties
    # every slot ran its passes through the rounds, and slots met in them
    assert passes > rounds > 0, (passes, rounds)


@pytest.mark.native
def test_slots_in_auto_share_the_drafters(tiny_gguf: Path, tiny_model: Any) -> None:
    """Every slot in auto at once: the engine's one common_speculative drafts for each slot's sequence, on the
    decode thread between the rounds. Each slot's tokens equal its prompt's greedy ar (near-tie rule), with n-gram
    rounds (prompts that repeat a phrase) and block rounds among them."""
    prompts = [([40 + 7 * i + k for k in range(5 + i)] * 30)[:100] for i in range(4)]
    got, _ = _auto_slots_against_ar(tiny_gguf, tiny_model, prompts, 40)
    rounds = {k: sum(r.stats.auto_rounds[k] for r in got) for k in ("none", "ngram", "block")}
    assert rounds["ngram"] > 0 and rounds["block"] > 0, rounds
    # a draft longer than the recurrent rollback, rejected early: the slot restores its own state and replays
    assert sum(r.stats.replays for r in got) > 0


def _auto_slots_against_ar(gguf: Path, tiny_model: Any, prompts: list[list[int]],
                           max_tokens: int) -> tuple[list[Any], tuple[int, int]]:
    """One slot per prompt, all in auto at once, each slot's tokens checked against its prompt's greedy ar on a
    single-slot engine (near-tie rule); the slots' results and the engine's block_pass_stats."""
    from clover_cpp.model import Model

    with Model(gguf, n_ctx=1024) as solo:
        want = []
        for p in prompts:
            solo.reset()
            want.append(list(solo.run(p, mode="ar", max_tokens=max_tokens, stop_ids=[]).tokens))

    def generate(model: Any, i: int) -> Any:
        model.reset()
        return model.run(prompts[i], mode="auto", max_tokens=max_tokens, stop_ids=[])

    n = len(prompts)
    with Model(gguf, n_ctx=1024 * n, n_parallel=n) as model:
        got = run_concurrently(lambda i: generate(model.slot(i), i), n)
        block_stats = model.block_pass_stats()
    ledger = Ledger()
    for i in range(n):
        assert not isinstance(got[i], BaseException), f"slot {i}: {got[i]!r}"
        ledger.check(f"auto slot{i}", list(got[i].tokens), want[i], tiny_model, prompts[i])
    assert len(ledger.near_ties) <= 1, ledger.near_ties
    return got, block_stats


@pytest.mark.native
def test_slots_in_auto_batch_their_block_drafts(tiny_gguf: Path, tiny_model: Any) -> None:
    """Slots in auto waiting on a draft at once get theirs from one call of the framework, which runs the block
    windows of all of them as one pass, as llama-server's slots do. Prompts that repeat nothing leave ngram-mod
    without a draft, so each slot's first rounds are block drafts (draft-clover drafts until it has timed a block
    round); three slots that start together meet in those rounds. Each slot's tokens equal its prompt's greedy ar
    (near-tie rule)."""
    prompts = [[100 + 37 * i + 3 * k for k in range(40)] for i in range(3)]
    got, (windows, rounds) = _auto_slots_against_ar(tiny_gguf, tiny_model, prompts, 24)
    for i, r in enumerate(got):
        assert r.stats.auto_rounds["block"] > 0, (i, r.stats.auto_rounds)
    assert windows == sum(r.stats.block_passes for r in got), windows
    assert windows > rounds > 0, f"no block draft was batched ({windows} windows in {rounds} passes)"


@pytest.mark.native
def test_slot_handles_and_single_slot_only_features(tiny_gguf: Path) -> None:
    from clover_cpp.model import EngineError, Model

    with Model(tiny_gguf, n_ctx=512, n_parallel=2) as model:
        assert model.slot(0) is model and model.slot(1).n_parallel == 2
        with pytest.raises(ValueError, match="slot 2 is out of range"):
            model.slot(2)
        with pytest.raises(EngineError, match="one slot"):
            model.history_state()
        second = model.slot(1)
    with pytest.raises(EngineError, match="closed"):
        second.n_past
    with pytest.raises(ValueError, match="n_parallel"):
        Model(tiny_gguf, n_parallel=0)


@pytest.mark.native
def test_slots_that_do_not_fit_host_memory_are_refused_with_the_numbers(tiny_gguf: Path) -> None:
    """The context of N slots is checked against the host's available memory at load (llama.cpp's no_alloc dry
    run), here made to fail by a margin larger than any machine."""
    from clover_cpp.model import EngineError, Model
    from clover_cpp.offload import Offload

    with pytest.raises(EngineError, match=r"2 slots do not fit host memory: their context needs \d+ MiB "
                                          r"\(KV cache and recurrent state \d+, compute \d+ MiB\)"):
        Model(tiny_gguf, n_parallel=2, offload=Offload(fit_target_mib=2**30))
    with Model(tiny_gguf, n_parallel=1, offload=Offload(fit_target_mib=2**30)) as one:  # one slot: no host check
        assert one.n_parallel == 1


@pytest.fixture(scope="module")
def coreset_gguf(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(tiny_checkpoint, module_tmp("coreset") / "tiny-core05.gguf", "f32",
                          "--coreset-top-p", "0.5")


# each slot's coreset top_p (None: the GGUF's 0.5); 1 is per-row routing inside a pass that has the coreset ops
CORESET_PAIRS = [(None, None), (None, 1.0), (0.9, None)]


@pytest.mark.native
@pytest.mark.parametrize("top_ps", CORESET_PAIRS, ids=["0.5+0.5", "0.5+1", "0.9+0.5"])
def test_slots_with_the_block_coreset_equal_their_solo_runs(coreset_gguf: Path, tiny_model: Any,
                                                            top_ps: tuple[float | None, float | None]) -> None:
    """spec 3.3 in a batched pass: one coreset per sequence's window, at that slot's own top_p. Two diffusion
    slots of a GGUF whose coreset_top_p is 0.5, with the same or different per-call top_p, decode concurrently,
    their block passes batched into shared rounds, and each answers as it does alone."""
    from clover_cpp.model import Model

    overlap = Overlap()

    def diffusion(model: Any, i: int, concurrent: bool = False) -> tuple[list[int], list[int]]:
        model.reset()
        ids = model.tokenize(PROMPTS[i])
        if concurrent and i == 1:
            overlap.second_starts()
        return ids, list(model.run(ids, mode="diffusion", block_size=8, threshold=0.006, max_tokens=24,
                                   stop_ids=[], coreset_top_p=top_ps[i],
                                   on_tokens=overlap.first_tokens if concurrent and i == 0 else None).tokens)

    with Model(coreset_gguf, n_ctx=1024) as solo:
        assert abs(solo.info.coreset_top_p - 0.5) < 1e-7
        want = [diffusion(solo, i) for i in range(2)]
    with Model(coreset_gguf, n_ctx=2048, n_parallel=2) as model:
        got = run_concurrently(lambda i: diffusion(model.slot(i), i, concurrent=True), 2)
        passes, rounds = model.block_pass_stats()
    ledger = Ledger()
    for i in range(2):
        assert not isinstance(got[i], BaseException), f"slot {i}: {got[i]!r}"
        context, want_tokens = want[i]
        ledger.check(f"coreset-slot{i}", got[i][1], want_tokens, tiny_model, context)
    ledger.assert_budget()
    assert passes > rounds > 0, f"no block pass was batched ({passes} block passes in {rounds} rounds)"


@pytest.mark.native
def test_a_long_prompt_in_chunks_shares_its_rounds(tiny_gguf: Path, tiny_model: Any) -> None:
    """--prefill-chunk: slot 1 decodes while slot 2 prefills a long prompt in chunks of 16; each slot's answer
    equals its solo run with the default chunk (the near-tie rule), and slot 1's steps shared rounds with the
    chunks (causal passes of different lengths batched together)."""
    from clover_cpp.model import Model

    short = list(range(40, 72))
    long = [(7 * i) % 2900 + 50 for i in range(300)]
    with Model(tiny_gguf, n_ctx=1024) as solo:
        want = [solo.run(p, mode="ar", max_tokens=n, stop_ids=[]).tokens for p, n in ((short, 48), (long, 8))]
    overlap = Overlap()  # the prompt is chunked only while another slot generates: slot 0 goes first

    def run(i: int) -> list[int]:
        if i == 1:
            overlap.second_starts()
        return model.slot(i).run((short, long)[i], mode="ar", max_tokens=(48, 8)[i], stop_ids=[],
                                 on_tokens=overlap.first_tokens if i == 0 else None).tokens

    with Model(tiny_gguf, n_ctx=2048, n_parallel=2, prefill_chunk=16) as model:
        got = run_concurrently(run, 2)
        passes, rounds = model.pass_stats()
    ledger = Ledger()
    for i, context in enumerate((short, long)):
        assert not isinstance(got[i], BaseException), got[i]
        ledger.check(f"chunked/slot{i}", got[i], want[i], tiny_model, context)
    assert len(ledger.near_ties) <= 1, ledger.near_ties
    assert passes > rounds > 0, (passes, rounds)
