"""Native tests of the `clover` architecture in the patched llama.cpp (spec 3, docs/native.md).

Through llama-cpp-python's low-level API and clover_native.bindings. Parity bounds are relative to
max(1, max|reference logit|). Every measured difference is written to build/native-parity.json.
Without the native build these tests skip with the reason; with CLOVER_REQUIRE_NATIVE=1 they fail.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from clover_dev.convert import clover_convert, quantize
from clover_dev.native import block_window
from tests.support.native import assert_parity, dump_results, load_in_subprocess, record, rewrite_gguf
from tests.support.routing import (NEAR_TIE, NativeRouterMargins, assert_parity_routed, routing_margins,
                             routing_near_ties)
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native  # every test here runs the native build (skipped without it; a failure in CI)

REF_TOL = 1e-3     # vs the PyTorch reference
STOCK_TOL = 1e-5   # vs stock qwen35moe in the same build
BATCH_TOL = 1e-4   # the same rows batched differently (a 1-row pass takes the vector kernels, a wider one the GEMMs)
Q8_DECISIVE_GAP = 0.1  # q8_0 check: top-2 gap > 0.1 * max(1, max|logit|)
N_IDS = 340        # 300 of history + a 32-wide window
PROMPT_LENGTHS = (1, 7, 64, 300)
BLOCK_POSITIONS = (0, 1, 37, 300)
BLOCK_SIZES = (1, 4, 8, 32)
CANVASES = ("masked", "partly", "filled")


@pytest.fixture(scope="module", autouse=True)
def _record_results() -> Any:
    """Write the measured differences once the module's tests are done (build/native-parity.json)."""
    yield
    dump_results()


def _ids(seed: int, vocab: int) -> list[int]:
    # ordinary tokens only (ids below the added special tokens)
    return np.random.default_rng(seed).integers(0, min(vocab, 3000), size=N_IDS).tolist()


class Bundle:
    """One test model: reference, f32 GGUF, native model, ids, and cached reference results."""

    def __init__(self, name: str, checkpoint: Path, ref_model: Any, tmp: Path) -> None:
        from clover_native import bindings

        self.name = name
        self.checkpoint = checkpoint
        self.ref = ref_model
        self.gguf = clover_convert(checkpoint, tmp / f"{name}-f32.gguf", "f32")
        self.model = bindings.LlamaModel(self.gguf)
        self.mask = self.model.mask_token()
        self.block_size = int(self.model.meta("clover_moe.block_size"))
        self.ids = _ids(1234, self.model.n_vocab)
        # reference: one causal run over 300 tokens, keeping the history at each block position
        self.hist: dict[int, Any] = {}
        rows = []
        h = ref_model.new_history()
        prev = 0
        with torch.no_grad():
            for p in BLOCK_POSITIONS:
                if p > prev:
                    rows.append(ref_model.forward_causal(self.ids[prev:p], h).float().numpy())
                    prev = p
                self.hist[p] = h.clone()
        self.ref_causal = np.concatenate(rows)  # [300, vocab], row i predicts token i+1
        self._block_cache: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}

    def ref_block(self, p: int, window: list[int]) -> np.ndarray:
        key = (p, tuple(window))
        if key not in self._block_cache:
            with torch.no_grad():
                self._block_cache[key] = self.ref.forward_block(window, self.hist[p].clone()).float().numpy()
        return self._block_cache[key]

    def context(self, **kw: Any):
        from clover_native import bindings

        kw.setdefault("n_ctx", 512)
        kw.setdefault("n_ubatch", 64)
        return bindings.Context(self.model, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint: Path, tiny_model: Any, module_tmp: MkTemp) -> Bundle:
    return Bundle("tiny", tiny_checkpoint, tiny_model, module_tmp("native-tiny"))


@pytest.fixture(scope="module")
def mid(mid_checkpoint: Path, mid_model: Any, module_tmp: MkTemp) -> Bundle:
    return Bundle("mid", mid_checkpoint, mid_model, module_tmp("native-mid"))


@pytest.fixture(scope="module", params=["tiny", "mid"])
def bundle(request: pytest.FixtureRequest) -> Bundle:
    return request.getfixturevalue(request.param)


# ------------------------------------------------------------------------------------------ loading
def test_metadata_and_rollback_support(tiny: Bundle) -> None:
    m = tiny.model
    assert m.meta("general.architecture") == "clover_moe"
    assert tiny.block_size == 8
    assert tiny.mask == 3007
    ctx = tiny.context(n_rs_seq=7)
    # llm_arch_supports_rs_rollback: otherwise n_rs_seq is silently clamped to 0
    assert ctx.n_rs_seq == 7


# ------------------------------------------------------------------------------------------ causal parity
@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_causal_prompt_parity(bundle: Bundle, n: int) -> None:
    ctx = bundle.context()
    got = ctx.causal(bundle.ids[:n])
    assert_parity(f"causal/{bundle.name}/prompt{n}", got, bundle.ref_causal[:n], REF_TOL)


def test_causal_token_by_token_parity(bundle: Bundle) -> None:
    ctx = bundle.context()
    prefill = 64
    first = ctx.causal(bundle.ids[:prefill], rows=[prefill - 1])
    rows = [first[0]]
    for t in bundle.ids[prefill:prefill + 24]:
        rows.append(ctx.causal([t])[0])
    got = np.stack(rows)
    assert_parity(f"causal/{bundle.name}/token_by_token", got, bundle.ref_causal[prefill - 1:prefill + 24], REF_TOL)


# ------------------------------------------------------------------------------------------ block parity
def _block_cases(model: str) -> list[tuple[int, int, str]]:
    return [(p, b, c) for p in BLOCK_POSITIONS for b in BLOCK_SIZES for c in CANVASES]


@pytest.mark.parametrize("model", ["tiny", "mid"])
def test_block_pass_parity(request: pytest.FixtureRequest, model: str) -> None:
    bundle: Bundle = request.getfixturevalue(model)
    from clover_native import bindings

    worst: dict[str, float] = {"max_abs_diff": 0.0, "rel": 0.0}
    for p in BLOCK_POSITIONS:
        ctx = bundle.context()
        if p:
            ctx.causal(bundle.ids[:p], rows=[p - 1])
        for p_, b, canvas in _block_cases(model):
            if p_ != p:
                continue
            window = block_window(bundle.ids, p, b, canvas, bundle.mask)
            got = ctx.block(window)
            ref = bundle.ref_block(p, window)
            m = assert_parity_routed(f"block/{model}/p{p}/B{b}/{canvas}", got, ref, REF_TOL, bundle.ref,
                                     lambda: bundle.ref.forward_block(window, bundle.hist[p].clone()))
            if m["rel"] > worst["rel"]:
                worst = {"max_abs_diff": m["max_abs_diff"], "rel": m["rel"], "case": f"p{p}/B{b}/{canvas}"}
        assert ctx.pos_max(bindings.HISTORY_SEQ) == p - 1
    record(f"block/{model}/worst", worst)


CORESET_TOP_PS = (0.9, 0.5)
CORESET_POSITIONS = (1, 37)


@pytest.mark.parametrize("model", ["tiny", "mid"])
def test_block_pass_parity_with_the_coreset(request: pytest.FixtureRequest, model: str) -> None:
    """spec 3.3: block passes routed inside the window's expert coreset == the reference, at top_p 0.9 and 0.5
    (top_p 1 is test_block_pass_parity), for B in {1, 4, 8, 32} and every canvas. A pass with a coreset near-tie
    (tests.support.routing.routing_near_ties) is left out of the strict check; at least half must have none (mid's
    random 16-expert router, nearly uniform, ties about a third of its passes)."""
    bundle: Bundle = request.getfixturevalue(model)
    strict = skipped = 0
    worst = 0.0
    top_ks = [layer.mlp.top_k for layer in bundle.ref.model.layers]
    for top_p in CORESET_TOP_PS:
        for p in CORESET_POSITIONS:
            ctx = bundle.context()
            ctx.set_coreset_top_p(top_p)
            ctx.causal(bundle.ids[:p], rows=[p - 1])
            for b in BLOCK_SIZES:
                for canvas in CANVASES:
                    window = block_window(bundle.ids, p, b, canvas, bundle.mask)
                    run = lambda: bundle.ref.forward_block(window, bundle.hist[p].clone(),  # noqa: E731
                                                           coreset_top_p=top_p)
                    routed = routing_margins(bundle.ref, run)
                    ties = routing_near_ties(routed.probs, top_ks, top_p)
                    got = ctx.block(window)
                    if ties:
                        skipped += 1
                        record(f"block-coreset/{model}/top_p{top_p}/p{p}/B{b}/{canvas}/near-tie", ties[:4])
                        continue
                    ref = routed.result.float().numpy()
                    m = assert_parity(f"block-coreset/{model}/top_p{top_p}/p{p}/B{b}/{canvas}", got, ref,
                                      REF_TOL)
                    worst = max(worst, m["rel"])
                    strict += 1
    record(f"block-coreset/{model}/summary", {"strict": strict, "near_tie_skipped": skipped, "worst_rel": worst})
    assert strict >= skipped, f"only {strict} of {strict + skipped} coreset passes were decisive"


def test_the_coreset_changes_routing_and_one_row_windows_route_per_row(tiny: Bundle) -> None:
    """A coreset below 1 changes a wide window's logits (it is really on); a one-row window is per-row routing
    at any top_p, bit for bit."""
    p = 37
    ctx = tiny.context()
    ctx.causal(tiny.ids[:p], rows=[p - 1])
    wide = block_window(tiny.ids, p, 8, "partly", tiny.mask)
    one = wide[:1]
    base_wide, base_one = ctx.block(wide), ctx.block(one)
    ctx.set_coreset_top_p(0.5)
    assert np.abs(ctx.block(wide) - base_wide).max() > 1e-2
    np.testing.assert_array_equal(ctx.block(one), base_one)


def _two_window_pass(ctx: Any, windows: list[list[int]], seqs: tuple[int, int]) -> list[np.ndarray]:
    """One block pass holding two windows of the same width, each on a scratch copy of the history (seq 0) under
    its own sequence id: the batched pass of two slots (clover_block_decode_seqs' protocol, here in one ubatch
    of two sequences). The logits of every row, per window."""
    from clover_native import bindings
    from clover_native.loader import llama

    L = llama()
    pos0 = ctx.pos_max(bindings.HISTORY_SEQ) + 1
    width = len(windows[0])
    batch = L.llama_batch_init(2 * width, 0, 1)
    try:
        for s, (window, seq) in enumerate(zip(windows, seqs)):
            L.llama_memory_seq_rm(ctx.mem, seq, -1, -1)
            L.llama_memory_seq_cp(ctx.mem, bindings.HISTORY_SEQ, seq, -1, -1)
            for j, tok in enumerate(window):
                i = s * width + j
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos0 + j, 1, 1
                batch.seq_id[i][0] = seq
        batch.n_tokens = 2 * width
        L.llama_set_causal_attn(ctx.ptr, False)
        rc = L.llama_decode(ctx.ptr, batch)
        L.llama_set_causal_attn(ctx.ptr, True)
        assert rc == 0, f"llama_decode returned {rc}"
        rows = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx.ptr, i), shape=(ctx.model.n_vocab,))
                         for i in range(2 * width)])
    finally:
        for seq in seqs:
            L.llama_memory_seq_rm(ctx.mem, seq, -1, -1)
        L.llama_batch_free(batch)
    return [rows[:width].copy(), rows[width:].copy()]


@pytest.mark.parametrize("top_ps", [(0.5, 1.0), (1.0, 0.5), (0.9, 0.5)])
def test_each_window_of_a_batched_pass_routes_in_its_own_sequences_coreset(tiny: Bundle, top_ps: tuple) -> None:
    """spec 3.3 per sequence (the context's LLAMA_CLOVER_PARAM_CORESET_TOP_P): two windows with different top_p in
    one block pass each equal their own solo pass at their own top_p, a window at 1 included (per-row routing inside
    a graph that has the coreset ops). A sequence without a value follows the GGUF's (1 here)."""
    from clover_native import bindings

    p, other = 37, 3
    ctx = tiny.context(n_seq_max=4)
    ctx.causal(tiny.ids[:p], rows=[p - 1])
    windows = [block_window(tiny.ids, p, 8, "partly", tiny.mask), block_window(tiny.ids, p, 8, "masked", tiny.mask)]
    solo = []
    for window, top_p in zip(windows, top_ps):
        ctx.set_coreset_top_p(top_p)
        solo.append(ctx.block(window))
    ctx.set_coreset_top_p(top_ps[0], seq=bindings.SCRATCH_SEQ)  # the pass below sets no value itself
    ctx.set_coreset_top_p(top_ps[1], seq=other)
    batched = _two_window_pass(ctx, windows, (bindings.SCRATCH_SEQ, other))
    for s in range(2):
        np.testing.assert_allclose(batched[s], solo[s], rtol=1e-5, atol=1e-5 * np.abs(solo[s]).max(),
                                   err_msg=f"window {s} at top_p {top_ps[s]}")
    # the coreset is really on for the window below 1: its logits differ from per-row routing, which is what a
    # sequence without a value gets from this GGUF
    low = int(np.argmin(top_ps))
    ctx.set_coreset_top_p(None)
    assert math.isnan(ctx.seq_param(bindings.HISTORY_SEQ, bindings.CORESET_TOP_P))
    per_row = ctx.block(windows[low])
    assert np.abs(per_row - solo[low]).max() > 1e-2
    ctx.set_coreset_top_p(1.0)
    np.testing.assert_array_equal(ctx.block(windows[low]), per_row)


def test_two_contexts_on_one_model_keep_their_own_coreset(tiny: Bundle) -> None:
    """The settings live on the context: a value set on one context's sequence changes nothing on another
    context of the same model (the same sequence id), before or after."""
    p = 37
    a, b = tiny.context(), tiny.context()
    for ctx in (a, b):
        ctx.causal(tiny.ids[:p], rows=[p - 1])
    window = block_window(tiny.ids, p, 8, "partly", tiny.mask)
    before = b.block(window)
    a.set_coreset_top_p(0.5)
    assert np.abs(a.block(window) - before).max() > 1e-2
    np.testing.assert_array_equal(b.block(window), before)


def test_sequence_settings_outside_the_range_are_refused(tiny: Bundle) -> None:
    from clover_native import bindings
    from clover_native.loader import NativeError

    ctx = tiny.context()
    for top_p in (1.5, -0.1, 0.0, float("nan")):
        with pytest.raises(NativeError, match="coreset_top_p must be in"):
            ctx.set_coreset_top_p(top_p)
    for seq in (-1, 2, 256):  # the context has sequences 0 and 1
        with pytest.raises(NativeError, match=f"refused sequence {seq}"):
            ctx.set_seq_param(seq, bindings.CORESET_TOP_P, 0.5)
    with pytest.raises(NativeError, match="refused sequence 0"):
        ctx.set_seq_param(0, "", 0.5)
    assert math.isnan(ctx.seq_param(0, bindings.CORESET_TOP_P))
    assert math.isnan(ctx.seq_param(7, bindings.CORESET_TOP_P))


def test_history_c_matters_only_below_history_rows(tiny: Bundle, tmp_path: Path) -> None:
    """spec 3.2 step 5: bd_history_c multiplies ln(W / history_rows): changing it changes nothing at
    W = history_rows (32) and changes the block logits at W < 32."""
    from clover_native import bindings

    changed = rewrite_gguf(tiny.gguf, tmp_path / "history-c.gguf",
                           tensor_edit=lambda name, data: data + 1.5 if name.endswith("bd_history_c") else data)
    p = 37
    out = {}
    for path in (tiny.gguf, changed):
        ctx = bindings.Context(bindings.LlamaModel(path), n_ctx=512, n_ubatch=64)
        ctx.causal(tiny.ids[:p], rows=[p - 1])
        out[path] = [ctx.block(block_window(tiny.ids, p, w, "partly", tiny.mask)) for w in (32, 8)]
    np.testing.assert_array_equal(out[tiny.gguf][0], out[changed][0])
    assert np.abs(out[tiny.gguf][1] - out[changed][1]).max() > 1e-3


def test_block_rows_subset(tiny: Bundle) -> None:
    """Logits only for chosen rows equal the same rows of a full-output pass."""
    ctx = tiny.context()
    ctx.causal(tiny.ids[:37])
    window = block_window(tiny.ids, 37, 8, "partly", tiny.mask)
    full = ctx.block(window)
    part = ctx.block(window, rows=[1, 3, 7])
    np.testing.assert_array_equal(part, full[[1, 3, 7]])


def test_near_tie_rule_still_fails_a_genuine_error(mid: Bundle, tmp_path: Path) -> None:
    """The routing near-tie rule (tests/support/routing.py) cannot excuse a real error. The window of the
    AVX-512 failure (p = 1, B = 32, filled; several of its rows are near-ties,
    tests/reference/test_routing_near_ties.py) runs on a copy of mid's f32 GGUF in which one expert's down
    projection in the last layer is scaled so that a decisive row's logits move by about 0.1 (25x the
    tolerance). Every near-tied flip is tried, and the check still fails, naming that row as decisive."""
    import gguf
    from clover_native import bindings

    p, b = 1, 32
    window = block_window(mid.ids, p, b, "filled", mid.mask)
    ref_model = mid.ref
    run = lambda: ref_model.forward_block(window, mid.hist[p].clone())  # noqa: E731
    ref, margins, ties, probs = routing_margins(ref_model, run)
    assert sum(len(layer) for layer in ties) > 0, "the window must hold near-ties for this test to mean anything"
    last = len(ref_model.model.layers) - 1
    decisive = [r for r in range(b) if margins[:, r].min() >= 2 * NEAR_TIE]
    row = decisive[0]
    expert = int(probs[last][row].argmax())  # the row's first expert in the last layer

    # the scale that moves that row by 0.1, from the reference (the change is linear in it)
    down = ref_model.model.layers[last].mlp.experts.down_proj
    probe = 0.05
    with torch.no_grad():
        down[expert] *= 1 + probe
        moved = float((run() - ref).abs()[row].max())
        down[expert] /= 1 + probe
    scale = probe * 0.1 / moved
    bad = tmp_path / "mid-f32-bad-expert.gguf"
    shutil.copyfile(mid.gguf, bad)
    reader = gguf.GGUFReader(str(bad), "r+")
    (tensor,) = [t for t in reader.tensors if t.name == f"blk.{last}.ffn_down_exps.weight"]
    tensor.data[expert] *= np.float32(1 + scale)
    reader.data.flush()
    del reader, tensor

    ctx = bindings.Context(bindings.LlamaModel(bad), n_ctx=512, n_ubatch=64)
    ctx.causal(mid.ids[:p], rows=[p - 1])
    got = ctx.block(window)
    error = float(np.abs(got[row] - ref[row].numpy()).max())
    record("block/mid/injected_expert_error", {"row": row, "expert": expert, "scale": scale, "row_error": error})
    assert error > 0.05, error
    with pytest.raises(AssertionError, match=rf"row {row} \([^)]*decisive\)"):
        assert_parity_routed("block/mid/injected", got, ref.numpy(), REF_TOL, ref_model, run)


def test_native_router_margins_equal_the_reference(mid: Bundle) -> None:
    """tests.support.routing.NativeRouterMargins reads the graph's router probabilities (ffn_moe_probs) right: on
    the f32 file its per-row margins equal the reference's, near-ties included."""
    router = NativeRouterMargins(top_k=mid.ref.config.num_experts_per_tok)
    ctx = mid.context(eval_callback=router.eval_callback)
    ctx.causal(mid.ids[:1], rows=[0])
    router.end_pass("causal", 1, [0])
    window = block_window(mid.ids, 1, 32, "filled", mid.mask)
    ctx.block(window)
    router.end_pass("block", len(window))
    margins = routing_margins(mid.ref, lambda: mid.ref.forward_block(window, mid.hist[1].clone())).margins
    got = np.array(router.margins["block"])
    record("block/mid/router_margin_max_abs_diff", float(np.abs(got - margins.min(0)).max()))
    np.testing.assert_allclose(got, margins.min(0), rtol=0, atol=1e-4)
    tight = margins.min(0) < NEAR_TIE  # the window's near-tied rows are near-ties natively too
    assert tight.any() and (got[tight] < NEAR_TIE + 1e-4).all(), (got[tight], margins.min(0)[tight])


# ------------------------------------------------------------------------------------------ stock qwen35moe
@pytest.fixture(scope="module")
def stock_tiny(tiny: Bundle, module_tmp: MkTemp) -> Path:
    from clover_dev.convert import make_qwen_twin, vendored_convert

    tmp = module_tmp("stock")
    twin = make_qwen_twin(tiny.checkpoint, tmp / tiny.checkpoint.name)
    return vendored_convert(twin, tmp / "qwen35moe-f32.gguf", "f32")


def test_causal_equals_stock_qwen35moe(tiny: Bundle, stock_tiny: Path, tmp_path: Path) -> None:
    """Same build: clover's causal graph vs stock qwen35moe on llama.cpp's own conversion of the twin.

    The comparison uses the clover file with stock's `ssm_a` (-exp(A_log)) copied in, so it isolates the
    graph even if the converters round that one computed tensor differently (seen once: 1 ulp). The
    converters' largest weight difference and the as-converted logit difference are recorded alongside."""
    import gguf
    from clover_native import bindings

    stock_reader = gguf.GGUFReader(str(stock_tiny))
    stock_tensors = {t.name: np.array(t.data, dtype=np.float32) for t in stock_reader.tensors}
    clover_reader = gguf.GGUFReader(str(tiny.gguf))
    weight_diff = 0.0
    for t in clover_reader.tensors:
        if t.name in stock_tensors:
            a = np.array(t.data, dtype=np.float32)
            assert a.shape == stock_tensors[t.name].shape, t.name
            weight_diff = max(weight_diff, float(np.abs(a - stock_tensors[t.name]).max()))
    record("stock/tiny/max_weight_diff_between_converters", weight_diff)

    same = rewrite_gguf(tiny.gguf, tmp_path / "clover-stock-ssm_a.gguf",
                        tensor_edit=lambda n, d: stock_tensors[n].reshape(d.shape) if n.endswith(".ssm_a") else d)
    clover_same = bindings.LlamaModel(same)
    stock = bindings.LlamaModel(stock_tiny)
    assert stock.meta("general.architecture") == "qwen35moe"
    for n in (7, 300):
        want = bindings.Context(stock, n_ctx=512, n_ubatch=64).causal(tiny.ids[:n])
        got = bindings.Context(clover_same, n_ctx=512, n_ubatch=64).causal(tiny.ids[:n])
        assert_parity(f"stock/tiny/prompt{n}", got, want, STOCK_TOL)
        record(f"stock/tiny/prompt{n}/bitwise_equal", bool(np.array_equal(got, want)))
        as_converted = tiny.context().causal(tiny.ids[:n])
        record(f"stock/tiny/prompt{n}/as_converted_max_abs_diff", float(np.abs(as_converted - want).max()))


# ------------------------------------------------------------------------------------------ exact checks
def test_history_untouched_by_block_passes(bundle: Bundle) -> None:
    rng = np.random.default_rng(7)
    p, tail = 37, bundle.ids[37:47]
    a = bundle.context()
    a.causal(bundle.ids[:p])
    for _ in range(5):
        b = int(rng.choice([1, 4, 8, 32]))
        canvas = str(rng.choice(CANVASES))
        a.block(block_window(bundle.ids, p, b, canvas, bundle.mask))
    got = a.causal(tail)
    clean = bundle.context()
    clean.causal(bundle.ids[:p])
    want = clean.causal(tail)
    record(f"exact/{bundle.name}/history_untouched_max_abs_diff", float(np.abs(got - want).max()))
    np.testing.assert_array_equal(got, want)


def test_rollback_exact(bundle: Bundle) -> None:
    ids = bundle.ids
    a = bundle.context(n_rs_seq=8)
    a.causal(ids[:20])
    a.causal(ids[20:26])       # k = 26
    a.rollback(23)             # keep j = 23
    got = a.causal(ids[23:30])
    b = bundle.context(n_rs_seq=8)
    b.causal(ids[:20])
    b.causal(ids[20:23])
    want = b.causal(ids[23:30])
    record(f"exact/{bundle.name}/rollback_max_abs_diff", float(np.abs(got - want).max()))
    np.testing.assert_array_equal(got, want)


def _moved_then_rolled_back(bundle: Bundle, drafts: int) -> np.ndarray:
    """Sequences 0, 1, 2 laid out in cells 1, 2, 0; sequence 0 appends 1 + ``drafts`` tokens in a batch with one
    token each of sequences 1 and 2 (a server's verification beside two ar slots), keeps the first and decodes the
    next two: sequence 0's logits of those. The batch's second ubatch (sequences 1 and 2) gathers their cells into
    0 .. 1, which moves sequence 0's state to cell 2 while its rollback still needs the snapshots of cell 1."""
    ids = bundle.ids
    ctx = bundle.context(n_rs_seq=8, n_seq_max=3)
    ctx.causal_seqs([(2, ids[100:110])])
    ctx.causal_seqs([(0, ids[:10]), (1, ids[50:60])])
    ctx.causal_seqs([(0, ids[10:11 + drafts]), (1, ids[60:61]), (2, ids[110:111])])
    ctx.rollback(11, seq=0)
    return ctx.causal_seqs([(0, ids[11:13])])[0]


def test_rollback_of_a_state_another_ubatch_moved(bundle: Bundle) -> None:
    """A rollback reads the snapshots of the state it rolls back even when another ubatch of the same batch moved
    that state to another cell (the snapshots move with it). Equal to the same batches without the drafts, up to
    the rounding of a row computed in a ubatch of 8 rows rather than 1 (1e-6 of the logits here; a state read from
    the wrong cell moves them by a tenth or more)."""
    got = _moved_then_rolled_back(bundle, drafts=7)
    want = _moved_then_rolled_back(bundle, drafts=0)
    diff = float(np.abs(got - want).max())
    record(f"exact/{bundle.name}/moved_rollback_max_abs_diff", diff)
    assert diff <= 1e-4 * float(np.abs(want).max()), diff


@pytest.mark.parametrize("canvas", ["masked", "filled"])
def test_rollback_then_block_pass_exact(bundle: Bundle, canvas: str) -> None:
    """The scratch copy made right after a rollback reads the kept state (the seq_cp fix)."""
    ids = bundle.ids
    b_size = bundle.block_size
    a = bundle.context(n_rs_seq=8)
    a.causal(ids[:10])
    a.causal(ids[10:15])
    a.rollback(12)             # pending rollback of 3 positions
    window = block_window(ids, 12, b_size, canvas, bundle.mask)
    got = a.block(window)
    got_after = a.causal(ids[12:16])   # seq 0's own pending rollback still applies
    fresh = bundle.context(n_rs_seq=8)
    fresh.causal(ids[:10])
    fresh.causal(ids[10:12])
    want = fresh.block(window)
    want_after = fresh.causal(ids[12:16])
    record(f"exact/{bundle.name}/rollback_then_block/{canvas}_max_abs_diff", float(np.abs(got - want).max()))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_after, want_after)
    # and it matches the reference on the kept history
    ref_h = bundle.ref.new_history()
    with torch.no_grad():
        bundle.ref.forward_causal(ids[:12], ref_h)
        ref = bundle.ref.forward_block(window, ref_h).float().numpy()
    assert_parity(f"block/{bundle.name}/after_rollback/{canvas}", got, ref, REF_TOL)


# ------------------------------------------------------------------------------------------ fused passes
FUSED_CASES = [(37, 3, 4), (10, 1, 2), (64, 7, 8), (5, 2, 3)]  # (history, causal rows C, window W)


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_fused_pass_equals_its_two_passes(bundle: Bundle, top_p: float) -> None:
    """A fused pass (C causal rows, then a W-row block window in the same ubatch; LLAMA_CLOVER_PARAM_FUSED_WINDOW)
    gives the causal rows of a causal pass and the window rows of a block pass over the history those rows extend,
    with and without the window's coreset, to float32 rounding of the different batching; afterwards the history
    holds the causal rows only, and a rollback into them (keeping at least the first) leaves what a fresh context
    holding the kept history has, for a causal pass and for the next block pass."""
    ids, mask = bundle.ids, bundle.mask

    def context() -> Any:
        ctx = bundle.context(n_rs_seq=15)
        for seq in (0, 1):
            ctx.set_coreset_top_p(top_p, seq=seq)
        return ctx

    for h, c, w in FUSED_CASES:
        tokens, window = ids[h:h + c], [ids[h + c]] + [mask] * (w - 1)
        a = context()
        a.causal(ids[:h])
        got_c, got_w = a.fused(tokens, window)
        b = context()
        b.causal(ids[:h])
        want_c = b.causal(tokens)
        want_w = b.block(window)
        name = f"fused/{bundle.name}/top_p{top_p}/h{h}-c{c}-w{w}"
        assert_parity(f"{name}/causal", got_c, want_c, BATCH_TOL)
        assert_parity(f"{name}/window", got_w, want_w, BATCH_TOL)
        after = ids[h + c:h + c + 3]
        assert_parity(f"{name}/after", a.causal(after), b.causal(after), BATCH_TOL)
        keeps = range(h + 1, h + c + 1)
        if bundle.name != "tiny":  # the rollback does not depend on the model or the coreset (tiny sweeps it)
            keeps = sorted({h + 1, h + c}) if top_p == 1.0 else []
        for keep in keeps:  # a fused pass rolled back as the engine does after a rejection
            a = context()
            a.causal(ids[:h])
            a.fused(tokens, window, keep=keep)
            fresh = context()
            fresh.causal(ids[:keep])
            nxt = [ids[keep]] + [mask] * (w - 1)
            assert_parity(f"{name}/keep{keep}/block", a.block(nxt), fresh.block(nxt), BATCH_TOL)
            after = ids[keep:keep + 3]
            assert_parity(f"{name}/keep{keep}/causal", a.causal(after), fresh.causal(after), BATCH_TOL)


def test_the_fused_window_matches_the_reference(tiny: Bundle) -> None:
    """The fused window's rows == the PyTorch reference's block pass over the history and the causal rows."""
    ids, mask, h, c = tiny.ids, tiny.mask, 37, 5
    window = [ids[h + c]] + [mask] * (tiny.block_size - 1)
    ctx = tiny.context(n_rs_seq=15)
    ctx.causal(ids[:h])
    _, got = ctx.fused(ids[h:h + c], window)
    ref_h = tiny.ref.new_history()
    with torch.no_grad():
        tiny.ref.forward_causal(ids[:h + c], ref_h)
        ref = tiny.ref.forward_block(window, ref_h).float().numpy()
    assert_parity("fused/tiny/window_vs_reference", got, ref, REF_TOL)


def test_a_fused_window_outside_its_range_is_an_ordinary_causal_pass(tiny: Bundle) -> None:
    """The fused window is the history's LLAMA_CLOVER_PARAM_FUSED_WINDOW: a value below 1 (or unset) is no window,
    and the pass is the ordinary causal one; a sequence id the context lacks is refused."""
    from clover_native import bindings
    from clover_native.loader import NativeError

    ids, h = tiny.ids, 37
    want = tiny.context()
    want.causal(ids[:h])
    want_rows = want.causal(ids[h:h + 6])
    for value in (-1.0, 0.0, 0.5):
        ctx = tiny.context()
        ctx.causal(ids[:h])
        ctx.set_seq_param(bindings.HISTORY_SEQ, bindings.FUSED_WINDOW, value)
        np.testing.assert_array_equal(ctx.causal(ids[h:h + 6]), want_rows, err_msg=f"fused window {value}")
    with pytest.raises(NativeError, match="refused sequence -1"):
        tiny.context().set_seq_param(-1, bindings.FUSED_WINDOW, 4)


# ------------------------------------------------------------------------------------------ tokenizer
BATTERY = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Hello, world! How's it going?  Fine.",
    "日本語のテキストと中文字符，한국어도 있습니다。",
    "emoji: 😀🎉👍🏽 and ZWJ 👨‍👩‍👧",
    "   leading spaces\t\ttabs\n\n\nnewlines    trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "mask <|mask|> inside text",
    "numbers 1234567890 3.14159 -42 1e-5 0x1F",
    "mixed: naïve café résumé — “quotes” ‘single’ …",
    "",
    "a",
    "    ",
    "\n",
    "https://example.com/path?query=1&b=2#frag",
    "{\"json\": [1, 2, {\"k\": null}]}",
]


def test_tokenization_matches_hf(tiny: Bundle) -> None:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tiny.checkpoint / "tokenizer.json"))
    mismatches = []
    for text in BATTERY:
        want = hf.encode(text, add_special_tokens=False).ids
        got = tiny.model.tokenize(text, add_special=False, parse_special=True)
        if got != want:
            mismatches.append((text, got, want))
    record("tokenizer/tiny/battery", {"strings": len(BATTERY), "mismatches": len(mismatches)})
    assert not mismatches, mismatches[:3]


# ------------------------------------------------------------------------------------------ broken files
def _conv_right_shape_wrong(name: str, data: np.ndarray) -> np.ndarray:
    return data.T.copy() if name == "blk.0.bd_conv_right.weight" else data


def _conv_right_kernel_4(name: str, data: np.ndarray) -> np.ndarray:
    return np.concatenate([data, data[:, :1]], axis=1) if name.endswith("bd_conv_right.weight") else data


@pytest.mark.parametrize("case,expect", [
    ("block_size_0", "block_size"),
    ("mask_id_out_of_range", "mask_token_id"),
    ("missing_tensor", "blk.1.bd_logit_scale"),
    ("wrong_shape", "bd_conv_right"),
    ("conv_right_kernel_4", "bd_conv_right"),
    ("coreset_top_p_0", "coreset_top_p"),
    ("shift_logits_false", "shift"),
    ("arch_v1", "spec v1"),
])
def test_broken_metadata_fails_cleanly(tiny: Bundle, tmp_path: Path, case: str, expect: str) -> None:
    out = tmp_path / f"{case}.gguf"
    if case == "block_size_0":
        rewrite_gguf(tiny.gguf, out, kv={"clover_moe.block_size": 0})
    elif case == "mask_id_out_of_range":
        rewrite_gguf(tiny.gguf, out, kv={"tokenizer.ggml.mask_token_id": tiny.model.n_vocab})
    elif case == "missing_tensor":
        rewrite_gguf(tiny.gguf, out, drop_tensors=["blk.1.bd_logit_scale"])
    elif case == "wrong_shape":
        rewrite_gguf(tiny.gguf, out, tensor_edit=_conv_right_shape_wrong)
    elif case == "conv_right_kernel_4":
        rewrite_gguf(tiny.gguf, out, tensor_edit=_conv_right_kernel_4)
    elif case == "coreset_top_p_0":
        rewrite_gguf(tiny.gguf, out, kv={"clover_moe.diffusion.coreset_top_p": 0.0})
    elif case == "shift_logits_false":
        rewrite_gguf(tiny.gguf, out, kv={"diffusion.shift_logits": False})
    else:
        rewrite_gguf(tiny.gguf, out, arch="clover")
    done = load_in_subprocess(out)
    text = done.stdout + done.stderr
    assert done.returncode == 3, f"expected a clean load error (rc 3), got rc {done.returncode}:\n{text[-2000:]}"
    assert expect in text, text[-2000:]
    record(f"broken/{case}", text.split("LOAD-ERROR:", 1)[-1].strip()[:300])


def test_rewrite_roundtrip_loads(tiny: Bundle, tmp_path: Path) -> None:
    """The rewriting helper itself produces a loadable file (so the failures above are the edits)."""
    out = rewrite_gguf(tiny.gguf, tmp_path / "same.gguf")
    done = load_in_subprocess(out)
    assert done.returncode == 0 and "LOADED" in done.stdout, done.stdout + done.stderr


# ------------------------------------------------------------------------------------------ q8_0
def test_q8_0_top1_agreement(bundle: Bundle, tmp_path: Path) -> None:
    import gguf
    from clover_native import bindings

    q8 = quantize(bundle.gguf, tmp_path / f"{bundle.name}-q8_0.gguf", "Q8_0")
    reader = gguf.GGUFReader(str(q8))
    types = {t.name: t.tensor_type for t in reader.tensors}
    clover = [n for n in types if ".bd_" in n]
    assert clover and all(types[n] == gguf.GGMLQuantizationType.F32 for n in clover)
    assert types["blk.0.attn_qkv.weight"] == gguf.GGMLQuantizationType.Q8_0

    qm = bindings.LlamaModel(q8)
    ids = bundle.ids
    f_ctx, q_ctx = bundle.context(), bindings.Context(qm, n_ctx=512, n_ubatch=64)
    pairs = [(f_ctx.causal(ids[:300]), q_ctx.causal(ids[:300]))]
    for canvas in CANVASES:
        w = block_window(ids, 300, bundle.block_size, canvas, bundle.mask)
        pairs.append((f_ctx.block(w), q_ctx.block(w)))
    f = np.concatenate([a for a, _ in pairs])
    q = np.concatenate([b for _, b in pairs])
    agree = f.argmax(-1) == q.argmax(-1)
    top2 = np.sort(f, axis=-1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > Q8_DECISIVE_GAP * max(1.0, float(np.abs(f).max()))
    rate, rate_decisive = float(agree.mean()), float(agree[decisive].mean())
    record(f"q8_0/{bundle.name}/top1_agreement", {
        "all_positions": rate, "positions": int(agree.size),
        "causal_only": float(agree[:300].mean()), "block_only": float(agree[300:].mean()),
        "decisive_positions": rate_decisive, "n_decisive": int(decisive.sum()),
        "max_abs_diff": float(np.abs(f - q).max())})
    # Random-weight test models have near-tied top-2 logits almost everywhere (median gap ~0.2 against a
    # q8_0 perturbation of up to 0.4 on mid and 2.8 on tiny, whose 64-wide layers and near-uniform routers
    # flip expert choices). The >= 99 % criterion is therefore checked on positions with a decisive f32
    # top-2 gap, on `mid` (real per-layer dims); the all-position rates are recorded, not asserted.
    if bundle.name == "mid":
        assert rate_decisive >= 0.99, (rate_decisive, rate)
