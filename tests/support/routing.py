"""The routing near-tie rule of the parity tests (docs/testing.md, "Routing near-ties").

A random-weight router is nearly uniform, so two experts' router probabilities can be closer than the
rounding of any two kernels: on one CPU the row takes the k-th expert, on another the (k+1)-th, and its
logits move by far more than the parity tolerance (0.1 against 0.0044, seen on AVX-512). The rule:

- A row is a **routing near-tie** when, in some MoE layer, the reference's router probability of its k-th
  expert exceeds that of its (k+1)-th by less than NEAR_TIE (k = num_experts_per_tok).
- Every row is first compared with the reference as it routes. A row that misses the tolerance there
  passes only if it meets the same tolerance against the reference re-run with one near-tied choice
  flipped: in one (layer, row) near-tie, the row takes its (k+1)-th expert in place of its k-th. The flip
  may be in another row, since rows of a block pass mix in later layers.
- So a decisive window must match the reference itself, and no row ever gets a looser tolerance: only an
  alternative routing, each one that a backend's rounding could pick. A genuine error (a wrong expert
  weight, a wrong tap) matches no variant and fails (tests/native/test_native_clover.py injects one).

The reference's routing is ``SparseMoe.route`` (clover_ref/model.py). With the block coreset of spec 3.3
(top_p < 1) there are two more places where backends may round apart, and ``routing_near_ties`` finds them:
a cut that is a near-tie (``clover_ref.coreset.cut_is_near_tie``: a cumulative mass within 1e-5 of top_p, or
tied block masses at the cut), and a row whose k-th and (k+1)-th experts inside the coreset are within
NEAR_TIE. Flips of those are not modelled: a coreset pass with any such tie is left out of the strict
comparison, and the tests require that most of their passes have none.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from clover_dev.metrics import parity
from tests.support.native import record

NEAR_TIE = 1e-3


@dataclass(frozen=True)
class NearTie:
    """Row ``row`` of an MoE call in layer ``layer``: its k-th and (k+1)-th experts, ``margin`` apart."""
    layer: int
    row: int
    margin: float
    kth: int
    next: int


def _moe_layers(model: Any) -> list[Any]:
    return [layer.mlp for layer in model.model.layers]


class RoutedPass(NamedTuple):
    """One reference pass with its routing: ``run()``'s result, the margins p_k - p_{k+1} as [layers, rows],
    each layer's near-ties (margin < NEAR_TIE), and each layer's router probabilities [rows, n_expert]."""
    result: Any
    margins: np.ndarray
    ties: list[list[NearTie]]
    probs: list[torch.Tensor]


def routing_margins(model: Any, run: Callable[[], Any]) -> RoutedPass:
    """Run ``run()`` (one reference pass: each MoE layer called once) with its routing recorded."""
    with recording_router_probs(model) as calls, torch.no_grad():
        result = run()
    assert len(calls) == len(_moe_layers(model)), "routing_margins expects one MoE call per layer (a block pass)"
    margins, ties = [], []
    for index, probs in enumerate(calls):
        k = _moe_layers(model)[index].top_k
        values, order = probs.sort(dim=-1, descending=True, stable=True)
        margin = (values[:, k - 1] - values[:, k]).numpy()
        margins.append(margin)
        ties.append([NearTie(index, int(r), float(margin[r]), int(order[r, k - 1]), int(order[r, k]))
                     for r in np.flatnonzero(margin < NEAR_TIE)])
    return RoutedPass(result, np.stack(margins), ties, calls)


@contextlib.contextmanager
def flipped(model: Any, tie: NearTie) -> Iterator[None]:
    """The reference with one near-tied choice flipped: in ``tie.layer``, ``tie.row`` takes its (k+1)-th
    expert in place of its k-th, weighted as the reference weights its top-k."""
    moe = _moe_layers(model)[tie.layer]

    def route(self: Any, x: torch.Tensor, coreset_top_p: float = 1.0, window: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        assert coreset_top_p == 1.0, "flips inside a coreset are not modelled yet"
        probs = self.router_probs(x)
        _, experts = probs.topk(self.top_k, dim=-1)
        experts = experts.clone()
        row = experts[tie.row]
        row[row == tie.kth] = tie.next
        weights = probs.gather(-1, experts)
        return weights / weights.sum(-1, keepdim=True), experts

    moe.route = types.MethodType(route, moe)
    try:
        yield
    finally:
        del moe.route


@dataclass
class RoutedParity:
    """The outcome of compare_with_near_ties: the rows that matched only a flipped routing, and why."""
    max_abs_diff: float
    tol: float
    flipped_rows: dict[int, NearTie]
    near_tie_rows: list[int]
    worst_row: int
    worst_row_margin: float

    def summary(self) -> dict[str, Any]:
        return {"max_abs_diff": self.max_abs_diff, "tol": self.tol, "near_tie_rows": self.near_tie_rows,
                "flipped": {str(r): vars(t) for r, t in self.flipped_rows.items()},
                "worst_row": self.worst_row, "worst_row_margin": self.worst_row_margin}


def compare_with_near_ties(name: str, got: np.ndarray, model: Any, run: Callable[[], torch.Tensor],
                           tol: float) -> RoutedParity:
    """Apply the near-tie rule to one reference pass ``run()`` (logits [rows, vocab]) against the native
    ``got``; ``tol`` is absolute. Raises AssertionError naming each row that matches no routing."""
    ref, margins, ties, _ = routing_margins(model, run)
    ref = ref.float().numpy().astype(np.float64)
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    row_diff = np.abs(got - ref).max(-1)
    min_margin = margins.min(0)
    worst = int(row_diff.argmax())
    flips: dict[int, NearTie] = {}
    failing = [int(r) for r in np.flatnonzero(row_diff > tol)]
    all_ties = sorted((t for layer in ties for t in layer), key=lambda t: t.margin)  # likeliest flip first
    if failing and all_ties:
        for tie in all_ties:
            with flipped(model, tie), torch.no_grad():
                variant = run().float().numpy().astype(np.float64)
            for r in list(failing):
                if np.abs(got[r] - variant[r]).max() <= tol:
                    flips[r] = tie
                    failing.remove(r)
            if not failing:
                break
    if failing:
        rows = ", ".join(f"row {r} (|diff| {row_diff[r]:.3g}, routing margin {min_margin[r]:.2g}, "
                         f"{'near-tie' if min_margin[r] < NEAR_TIE else 'decisive'})" for r in failing)
        raise AssertionError(f"{name}: max|diff| {row_diff.max():.3g} > tol {tol:.3g}, and no near-tied "
                             f"routing explains it: {rows}")
    return RoutedParity(float(row_diff.max()), tol, flips, [int(r) for r in np.flatnonzero(min_margin < NEAR_TIE)],
                        worst, float(min_margin[worst]))


def assert_parity_routed(name: str, got: np.ndarray, ref: np.ndarray, rel: float, model: Any,
                         run: Callable[[], torch.Tensor]) -> dict[str, Any]:
    """tests.support.native.assert_parity with the near-tie rule: ``ref`` is the reference's logits of the pass
    that ``run()`` repeats on ``model``. Only a pass that misses the tolerance is re-run, with its routing
    margins, and then every row must match the reference or one near-tied flip of it."""
    m = parity(got, ref, rel)
    if m["max_abs_diff"] > m["tol"]:
        m["near_ties"] = compare_with_near_ties(name, got, model, run, m["tol"]).summary()
    else:
        assert m["top1_mismatch_decisive"] == 0, f"{name}: top-1 differs on {m['top1_mismatch_decisive']} rows"
    record(name, m)
    return m


class NativeRouterMargins:
    """The native graph's own routing margins, read through the scheduler's eval callback: llama.cpp names
    each MoE layer's router probabilities ``ffn_moe_probs-IL`` ([n_expert, n_tokens], F32 on the CPU).
    Give ``eval_callback`` to bindings.Context, call ``end_pass`` after each pass, and ``margins[kind]`` holds,
    for every output row of that kind of pass, the smallest p_k - p_{k+1} over the MoE layers that saw it.

    Reading a tensor splits the graph there, so use a context of its own for this, not the one whose
    logits are compared."""

    NAME = re.compile(rb"ffn_moe_probs-(\d+)")  # not its views ("ffn_moe_probs-0 (reshaped)")

    def __init__(self, top_k: int) -> None:
        import ctypes

        from clover_native import loader

        ggml = ctypes.CDLL(str(loader.lib_dir() / "libggml-base.so"))
        ggml.ggml_get_name.restype = ctypes.c_char_p
        ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
        for fn in (ggml.ggml_nrows, ggml.ggml_nelements):
            fn.restype = ctypes.c_int64
            fn.argtypes = [ctypes.c_void_p]
        ggml.ggml_get_data_f32.restype = ctypes.POINTER(ctypes.c_float)
        ggml.ggml_get_data_f32.argtypes = [ctypes.c_void_p]
        self.top_k = top_k
        self.margins: dict[str, list[float]] = {}
        self._calls: list[tuple[int, np.ndarray]] = []
        self._error: Exception | None = None

        def on_tensor(tensor: int, ask: bool, _user_data: int) -> bool:
            # an exception here would return False, which stops the graph: nothing in it may raise
            layer = self.NAME.fullmatch(ggml.ggml_get_name(tensor) or b"")
            if layer is None:
                return not ask
            if ask:
                return True
            try:
                rows, n = ggml.ggml_nrows(tensor), ggml.ggml_nelements(tensor)
                probs = np.ctypeslib.as_array(ggml.ggml_get_data_f32(tensor), shape=(n,)).reshape(rows, n // rows)
                top = -np.sort(-probs, axis=-1)
                self._calls.append((int(layer.group(1)), top[:, top_k - 1] - top[:, top_k]))
            except Exception as exc:
                self._error = exc
            return True

        self._callback = loader.llama().ggml_backend_sched_eval_callback(on_tensor)  # kept alive here
        self.eval_callback = (self._callback, None)

    def end_pass(self, kind: str, n_rows: int, out_rows: list[int] | None = None) -> None:
        """Close one pass (of ``kind``, e.g. causal or block) of ``n_rows`` rows that output ``out_rows``
        (all when None). A layer that ran on every row contributes those rows; the last layers run on the
        output rows only."""
        if self._error is not None:
            raise AssertionError(f"reading the router probabilities failed: {self._error!r}")
        out = list(range(n_rows)) if out_rows is None else out_rows
        by_layer: dict[int, list[np.ndarray]] = {}
        for layer, m in self._calls:
            by_layer.setdefault(layer, []).append(m)
        self._calls.clear()
        worst = np.full(len(out), np.inf)
        for parts in by_layer.values():
            m = np.concatenate(parts)
            if len(m) == n_rows:
                m = m[out]
            assert len(m) == len(out), f"a router saw {len(m)} rows of a {n_rows}-row pass with {len(out)} outputs"
            worst = np.minimum(worst, m)
        self.margins.setdefault(kind, []).extend(worst.tolist())


def routing_near_ties(probs: list[torch.Tensor], top_ks: list[int], top_p: float) -> list[str]:
    """The routing near-ties of one block pass from its router probabilities (one [rows, n_expert] per MoE
    layer): per row, the k-th and (k+1)-th experts closer than NEAR_TIE (inside the coreset when top_p < 1),
    and a coreset cut that is a near-tie."""
    from clover_ref.coreset import block_coreset, cut_is_near_tie

    found: list[str] = []
    for layer, (p, k) in enumerate(zip(probs, top_ks)):
        allowed = torch.ones(p.shape[-1], dtype=torch.bool)
        if top_p < 1.0 and p.shape[0] > 1:
            coreset = block_coreset(p, top_p, k)
            if cut_is_near_tie(coreset, top_p, k):
                found.append(f"layer {layer}: the cut")
            allowed = coreset.allowed(p.shape[-1])
        if int(allowed.sum()) <= k:
            continue
        values = p.masked_fill(~allowed, -1.0).sort(dim=-1, descending=True).values
        for row in np.flatnonzero((values[:, k - 1] - values[:, k]).numpy() < NEAR_TIE):
            found.append(f"layer {layer}: row {row}")
    return found


@contextlib.contextmanager
def recording_router_probs(model: Any) -> Iterator[list[torch.Tensor]]:
    """Inside the body, the router probabilities of each MoE call, in call order (a block pass: one per layer)."""
    calls: list[torch.Tensor] = []

    def hook(module: Any, inputs: tuple[torch.Tensor, ...], _output: Any) -> None:
        calls.append(module.router_probs(inputs[0]).float())

    handles = [moe.register_forward_hook(hook) for moe in _moe_layers(model)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()
