"""Auto mode (docs/decoding.md, "auto") and the engine's default thread count.

Auto drafts with llama.cpp's speculative framework (ngram-mod, then the gated draft-clover) and verifies with
libclover's distribution stage. It is lossless: every token comes from a causal verification, so greedy auto
equals greedy ar up to a near-tie of the reference (tests/support/engine.py), whatever was drafted: n-gram drafts
(a prompt that repeats itself), block drafts (draft-clover drafts until it has timed a block round, and probes
later), or nothing. A trained model checks that drafts are accepted, and that sampled auto keeps ar's
distribution.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.engine import Case, Ledger
from tests.support.homogeneity import homogeneity
from clover_dev import REPO_ROOT
from clover_dev.convert import clover_convert
from tests.support.native import dump_results, record
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native  # every test here runs the native build (skipped without it; a failure in CI)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint: Path, tiny_model: Any, module_tmp: MkTemp) -> Case:
    return Case(tiny_model, clover_convert(tiny_checkpoint, module_tmp("auto") / "tiny-f32.gguf", "f32"))


@pytest.fixture(scope="module")
def demo(module_tmp: MkTemp) -> Case:
    from clover_ref.checkpoint import load_model

    src = REPO_ROOT / "models" / "clover-demo"
    return Case(load_model(src), clover_convert(src, module_tmp("auto") / "demo-f32.gguf", "f32"))


def _prompt(rng: np.random.Generator, case: int) -> list[int]:
    """A short random prompt, or (every other case) a random phrase repeated until it is long enough for ngram-mod
    (24 tokens matched, 48 looked up), so that n-gram drafts are verified and mostly rolled back."""
    if case % 2 == 0:
        return rng.integers(0, 3000, size=int(rng.integers(1, 41))).tolist()
    phrase = rng.integers(0, 3000, size=int(rng.integers(3, 12))).tolist()
    return (phrase * (120 // len(phrase) + 1))[: int(rng.integers(90, 120))]


def test_auto_equals_ar(tiny: Case) -> None:
    """Random prompts, block sizes, budgets, stop and banned ids: greedy auto == greedy ar (near-tie rule), with
    n-gram rounds and block rounds among the cases."""
    rng = np.random.default_rng(7)
    ledger = Ledger()
    rounds = {"none": 0, "ngram": 0, "block": 0}
    drafted = accepted = 0
    for case in range(30):
        prompt = _prompt(rng, case)
        opts = {"block_size": int(rng.choice([4, 8, 32])), "max_tokens": int(rng.integers(1, 61)),
                "stop_ids": tiny.eos,
                "banned_ids": rng.integers(0, 3000, size=int(rng.integers(0, 3))).tolist() or None}
        ar = tiny.run(prompt, "ar", **opts)
        auto = tiny.run(prompt, "auto", **opts)
        ledger.check(f"auto==ar/{case}", auto.tokens, ar.tokens, tiny.ref, prompt, opts["banned_ids"])
        st = auto.stats
        # a replay decodes again what a long rejected draft's verification kept (docs/decoding.md, "Bounds")
        assert sum(st.auto_rounds.values()) == st.causal_passes - st.replays == sum(st.accepted_lengths)
        assert st.block_passes == st.auto_rounds["block"]
        assert st.auto_accepted <= st.auto_drafted
        for k in rounds:
            rounds[k] += st.auto_rounds[k]
        drafted += st.auto_drafted
        accepted += st.auto_accepted
    record("auto/equals_ar", {"cases": ledger.compared, "near_ties": ledger.near_ties, "rounds": rounds,
                              "drafted": drafted, "accepted": accepted})
    dump_results()
    ledger.assert_budget()
    # whether a random model's greedy text follows its prompt's repeats, so that drafts are accepted, depends on
    # its weights: test_auto_on_the_trained_model checks accepted drafts
    assert rounds["ngram"] > 0 and rounds["block"] > 0, rounds


def test_auto_on_the_trained_model(demo: Case) -> None:
    """Greedy auto equals ar on held-out code, drafts are accepted, and it takes fewer causal passes than
    tokens (its n-gram table learns from each call's text, as llama-server's does across requests)."""
    ledger = Ledger()
    texts = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n",
             "class Point:\n    def __init__(self, x, y):\n", "for i in range(10):\n    print(i)\n"]
    tokens = passes = accepted = 0
    for i, text in enumerate(texts):
        prompt = demo.model.tokenize(text)
        ar = demo.run(prompt, "ar", max_tokens=128, stop_ids=demo.eos)
        auto = demo.run(prompt, "auto", max_tokens=128, stop_ids=demo.eos)
        ledger.check(f"demo/{i}", auto.tokens, ar.tokens, demo.ref, prompt)
        tokens += auto.stats.generated_tokens
        passes += auto.stats.causal_passes
        accepted += auto.stats.auto_accepted
    record("auto/demo", {"tokens_per_pass": tokens / passes, "accepted": accepted, "near_ties": ledger.near_ties})
    dump_results()
    ledger.assert_budget()
    assert accepted > 0 and tokens / passes > 1.3, (tokens, passes, accepted)


def test_a_long_ngram_draft_is_verified_whole_and_replayed_when_rejected_early(demo: Case) -> None:
    """ngram-mod drafts 48 to 64 tokens; auto verifies them whole, as llama-server does, though the recurrent state
    rolls back only max_block_size - 1 positions: a verification that rejects more restores the state from before
    it and replays the kept tokens (docs/decoding.md, "Bounds"). Repeated code, with and without a banned token
    that the drafts hold (so that the model leaves the repeat there): greedy auto equals ar (near-tie rule), some
    rounds keep more than max_block_size tokens, and some replay."""
    ledger = Ledger()
    texts = ["x = compute(a, b)\n" * 6, "import os\nimport sys\nimport json\nimport time\n" * 3]
    long_rounds = replays = 0
    for i, text in enumerate(texts):
        prompt = demo.model.tokenize(text)
        for ban in (None, sorted(set(prompt))[1]):
            opts = {"max_tokens": 160, "stop_ids": demo.eos, "banned_ids": None if ban is None else [ban]}
            ar = demo.run(prompt, "ar", **opts)
            auto = demo.run(prompt, "auto", **opts)
            ledger.check(f"long/{i}/{ban}", auto.tokens, ar.tokens, demo.ref, prompt, opts["banned_ids"])
            st = auto.stats
            assert sum(st.auto_rounds.values()) == st.causal_passes - st.replays == sum(st.accepted_lengths)
            long_rounds += sum(st.accepted_lengths[demo.model.max_block_size + 1:])
            replays += st.replays
    ledger.assert_budget()
    assert long_rounds > 0 and replays > 0, (long_rounds, replays)


def test_a_stop_id_inside_a_draft_ends_the_round_there(demo: Case) -> None:
    """A stop id the drafts hold: auto and spec stop where ar stops (near-tie rule), without emitting it, whether
    the stop id lies inside a draft or past the budget. The prompt repeats a line, so that ngram-mod drafts the
    repeat from the first round."""
    prompt = demo.model.tokenize("x = compute(a, b)\n" * 6)
    free = demo.run(prompt, "ar", max_tokens=48, stop_ids=[]).tokens
    firsts = {t: free.index(t) for t in free}  # each token's first place in the continuation
    stops = sorted((k, t) for t, k in firsts.items() if k >= 3)[:4]
    assert stops, free
    ledger = Ledger()
    drafted = 0
    for k, t in stops:
        for budget in (48, k, k + 1):
            opts = {"max_tokens": budget, "stop_ids": [t], "block_size": 8}
            ar = demo.run(prompt, "ar", **opts)
            assert ar.tokens == free[:min(k, budget)], (k, t, budget)
            assert ar.stats.stop_reason == ("eos" if budget > k else "length"), (k, budget, ar.stats)
            for mode in ("auto", "spec"):
                r = demo.run(prompt, mode, **opts)
                ledger.check(f"stop/{mode}/{k}/{budget}", r.tokens, ar.tokens, demo.ref, prompt)
                if r.tokens == ar.tokens:
                    assert r.stats.stop_reason == ar.stats.stop_reason, (mode, k, budget, r.stats)
                drafted += r.stats.auto_drafted
    ledger.assert_budget()
    assert drafted > 0


def test_measuring_pass_costs_leaves_the_history(demo: Case) -> None:
    """Model.measure_pass_costs times passes on the scratch sequence: positive costs, and the next turn continues
    the history as if nothing had run."""
    m = demo.model
    prompt, more = m.tokenize("def fibonacci(n):\n"), m.tokenize("    return")
    m.reset()
    first = m.run(prompt, mode="ar", max_tokens=8, stop_ids=[]).tokens
    costs = m.measure_pass_costs()
    assert costs.ar_ms > 0 and costs.causal_fixed_ms + costs.causal_row_ms > 0 and costs.block_fixed_ms > 0, costs
    after = m.run(more, mode="ar", max_tokens=8, stop_ids=[]).tokens
    m.reset()
    assert m.run(prompt, mode="ar", max_tokens=8, stop_ids=[]).tokens == first
    assert m.run(more, mode="ar", max_tokens=8, stop_ids=[]).tokens == after


def test_auto_multi_turn_and_prefix(tiny: Case) -> None:
    """A second auto turn continues the history as a fresh prefill would; a smaller budget is a prefix."""
    m = tiny.model
    p1, p2 = [3, 14, 15, 92, 65, 35, 3, 14], [89, 79, 3, 14]
    m.reset()
    out1 = m.run(p1, mode="auto", block_size=8, max_tokens=20, stop_ids=[]).tokens
    out2 = m.run(p2, mode="auto", block_size=8, max_tokens=15, stop_ids=[]).tokens
    fresh = tiny.run(p1 + out1 + p2, "ar", max_tokens=15, stop_ids=[]).tokens
    ledger = Ledger()
    ledger.check("auto/multi-turn", out2, fresh, tiny.ref, p1 + out1 + p2)
    ledger.assert_budget()
    short = tiny.run(p1, "auto", block_size=8, max_tokens=7, stop_ids=[]).tokens
    long = tiny.run(p1, "auto", block_size=8, max_tokens=30, stop_ids=[]).tokens
    assert short == long[:7]


def test_sampled_auto_keeps_ars_distribution(demo: Case) -> None:
    """Sampled (temperature 1, a seed per call): the second token, which the first round's draft decides, is
    distributed as ar's. The prompt repeats a snippet, so ngram-mod drafts from the first round (asserted); a draft
    is accepted with probability Q(d), else the target samples Q without it (spec 4.5). A two-sample chi-square test
    of homogeneity at ALPHA whose power against a shift of SHIFT_TV in total variation is at least POWER (both
    asserted; tests/support/homogeneity.py)."""
    samples, alpha, shift_tv, power = 1200, 1e-3, 0.1, 0.9
    m = demo.model
    snippet = "    def push(self, item):\n        self.items.append(item)\n\n"
    prompt = m.tokenize("class Stack:\n" + snippet * 6)
    second: dict[str, list[int]] = {"ar": [], "auto": []}
    drafted = 0
    for mode, seeds in (("ar", range(samples)), ("auto", range(samples, 2 * samples))):
        for seed in seeds:
            r = demo.run(prompt, mode, temperature=1.0, seed=seed, max_tokens=3, stop_ids=[])
            second[mode].append(r.tokens[1])
            drafted += r.stats.auto_drafted
    assert drafted >= samples, f"auto drafted only {drafted} tokens in {samples} calls"
    homogeneity(second["ar"], second["auto"], alpha, shift_tv).assert_same(power)


def test_auto_sampling_runs(tiny: Case) -> None:
    """Sampled auto on a random model emits its budget."""
    prompt = [5, 9, 5, 9, 5, 9]
    a = tiny.run(prompt, "auto", temperature=0.8, top_k=50, seed=3, max_tokens=30, stop_ids=[])
    assert len(a.tokens) == 30 and a.stats.mode == "auto"


# ------------------------------------------------------------------------------------------ threads
def _default_threads(cpus: str) -> int:
    assert shutil.which("taskset"), "taskset (util-linux) is needed"
    code = "from clover_native import libclover; print(libclover.lib().clover_default_n_threads())"
    done = subprocess.run(["taskset", "-c", cpus, sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_default_threads_follow_the_affinity_mask(tiny: Case) -> None:
    """0 threads means the physical cores this process may use: taskset narrows them."""
    assert _default_threads("0") == 1
    cores = os.sched_getaffinity(0)
    if len(cores) >= 2:
        assert 1 <= _default_threads(",".join(str(c) for c in sorted(cores)[:2])) <= 2
    done = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "clover_cpp.cli", "generate", "-m",
                           str(tiny.gguf), "-p", "def f(x):", "--mode", "auto", "-n", "8", "--json"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)["stats"]
    assert stats["threads"] == 1 and stats["mode"] == "auto" and sum(stats["auto_rounds"].values()) > 0
