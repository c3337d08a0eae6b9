"""Quantized models on the CPU's extra buffer types agree with plain CPU buffers (docs/native.md, "AMX").

At load, llama.cpp moves quantized weights into extra buffer types when the CPU can use them: AMX tiles
(Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS on CPUs with AMX-INT8) or repacked interleaved layouts
(CPU_REPACK with AVX2: Q4_0, Q4_K, IQ4_NL). Each file below runs causal and block passes and all three
decoding modes twice, with and without them (``use_extra_bufts``, llama.cpp's --no-repack), in a
subprocess: a crash is this test's failure with its signal, and the rest of the run goes on.

The two settings are not bit-identical: the repacked kernels quantize the activations in their own layout,
so an int8 activation can round one step apart. What must hold:
- **logits:** KL(plain || extra) is at most KL_SHARE of KL(f16 || plain), the error quantization itself
  makes (measured on CPU_REPACK: 0.2-0.8 %), and top-1 agrees on every row whose top-2 gap exceeds twice the
  largest logit difference. A random router can flip an expert at a routing near-tie (tests/support/routing.py),
  and one flipped row outweighs the mean: when the bound is missed, both KLs are taken again over the rows
  that the plain model itself routes decisively (its router margins, read from the native graph).
  Failing both, the extra kernels must be as accurate as the plain ones: KL(f16 || extra) at most
  (1 + ACCURACY_SHARE) KL(f16 || plain). The reason is arithmetic. Both settings quantize every activation row
  to int8 blocks (Q8_0 / Q8_K) before the integer dot products, and their float sums differ only in order,
  by about 1e-7 relative (AMX against plain, layer by layer, on the demo's Q8_0). An activation that sits on a
  rounding boundary of the int8 grid then rounds to the other neighbour in one setting: an equally valid
  draw of the quantization error, one step of that grid, which later layers carry on. On the AMX Xeon this
  made the demo's and mid's Q8_0 logits differ by up to 0.17 on a third of the rows (KL 3-11 % of
  quantization's), with rows routed decisively, while each setting stayed as close to the f16 model as the
  other (KL(f16 || extra) / KL(f16 || plain): 1.01 causal and 0.98 block on demo, 1.00 and 0.99 on mid). A
  wrong kernel moves the logits away from the f16 model, which this still catches;
- **decoding:** greedy ar, diffusion and spec give the same tokens, or first differ at a decision of the
  plain model whose margin (top-2 gap, or distance of ln(confidence) to ln(threshold)) is below
  TIE_FACTOR times the largest logit difference measured between the settings: over the fixed passes, or
  at that decision replayed in both settings, whichever is larger (a repacked kernel may serve only some
  pass shapes: on an AVX-512 EPYC demo IQ4_XS gave bitwise-equal fixed passes and a diffusion step apart).
What this CPU exercised (AMX, or only the repacked layouts) is printed as a note.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from clover_dev import REPO_ROOT, VENV_PYTHON
from clover_dev.convert import clover_convert, quantize
from clover_dev.metrics import kl_top1
from tests.support.native import dump_results, record

from tests.support.routing import NEAR_TIE

from clover_native import cpu
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native  # every test here runs the native build (skipped without it; a failure in CI)

KL_SHARE = 0.05
ACCURACY_SHARE = 0.10  # another draw of the int8 activation rounding: as close to f16 as plain, within 10 %
TIE_FACTOR = 4.0  # a decision flips only when its margin is below 2x the logit change; 2x more for safety
PROBE = "tests.support.extra_bufts_probe"  # run as a module from the repository root
TYPES = ["Q8_0", "Q4_0", "Q4_K_M", "IQ4_XS"]


@pytest.fixture(scope="module")
def f16_models(module_tmp: MkTemp, mid_checkpoint: Path) -> dict[str, Path]:
    d = module_tmp("bufts")
    return {"demo": clover_convert(REPO_ROOT / "models" / "clover-demo", d / "demo-f16.gguf", "f16"),
            "mid": clover_convert(mid_checkpoint, d / "mid-f16.gguf", "f16")}


def run_probe(gguf: Path, f16: Path, out_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    env = dict(os.environ, CLOVER_NATIVE_QUIET="1", CLOVER_THREADS=os.environ.get("CLOVER_THREADS", "2"))
    done = subprocess.run([str(VENV_PYTHON), "-m", PROBE, str(gguf), str(f16), str(out_dir)], capture_output=True,
                          text=True, env=env, cwd=REPO_ROOT, timeout=900)
    if done.returncode < 0:
        pytest.fail(f"{gguf.name}: the probe crashed with {signal.Signals(-done.returncode).name} "
                    f"(CPU: {cpu.read_cpuinfo().summary()}):\n{done.stderr[-3000:]}", pytrace=False)
    assert done.returncode == 0, f"{gguf.name}: probe failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    result = json.loads((out_dir / "result.json").read_text())
    with np.load(out_dir / "logits.npz") as z:
        return result, {k: z[k].astype(np.float64) for k in z.files}


@pytest.mark.parametrize("model", ["demo", "mid"])
@pytest.mark.parametrize("qtype", TYPES)
def test_extra_buffer_types_agree_with_plain_buffers(model: str, qtype: str, f16_models: dict[str, Path],
                                                     tmp_path: Path, record_property) -> None:
    gguf = quantize(f16_models[model], tmp_path / f"{model}-{qtype}.gguf", qtype)
    result, logits = run_probe(gguf, f16_models[model], tmp_path)
    extra, plain = result["extra"], result["plain"]
    assert not {"AMX", "CPU_REPACK"} & set(plain["buffer_types"]), plain["buffer_types"]
    measured: dict = {"buffer_types": extra["buffer_types"]}
    max_diff = 0.0
    for kind in ("causal", "block"):
        a, b, f = logits[f"extra_{kind}"], logits[f"plain_{kind}"], logits[f"f16_{kind}"]
        assert a.shape == b.shape and np.isfinite(a).all(), f"{kind}: non-finite or misshapen logits"
        diff = float(np.abs(a - b).max())
        max_diff = max(max_diff, diff)
        kl_settings, _ = kl_top1(b, a)
        kl_quant, _ = kl_top1(f, b)
        top2 = np.sort(b, axis=-1)[:, -2:]
        decisive = (top2[:, 1] - top2[:, 0]) > 2 * diff
        flips = int((a.argmax(-1) != b.argmax(-1))[decisive].sum())
        measured[kind] = {"max_abs_diff": diff, "rel": diff / max(1.0, float(np.abs(b).max())),
                          "kl_settings": kl_settings, "kl_quantization": kl_quant, "decisive_flips": flips}
        # the routing near-tie rule: the same bound over the rows the plain model routes decisively
        routed = logits[f"plain_{kind}_margin"] >= NEAR_TIE
        kl_settings_routed, kl_quant_routed = float("inf"), 0.0  # no decisive row: the rule excuses nothing
        if routed.any():
            kl_settings_routed, _ = kl_top1(b[routed], a[routed])
            kl_quant_routed, _ = kl_top1(f[routed], b[routed])
        kl_extra, _ = kl_top1(f, a)
        measured[kind].update(near_tie_rows=np.flatnonzero(~routed).tolist(), kl_settings_decisive=kl_settings_routed,
                              kl_quantization_decisive=kl_quant_routed, kl_quantization_extra=kl_extra)
        assert (kl_settings <= KL_SHARE * kl_quant or kl_settings_routed <= KL_SHARE * kl_quant_routed
                or kl_extra <= (1 + ACCURACY_SHARE) * kl_quant), \
            f"{model} {qtype} {kind}: extra buffer types {extra['buffer_types']} move the logits by KL " \
            f"{kl_settings:.3g}, more than {KL_SHARE} of quantization's own {kl_quant:.3g}, and by " \
            f"{kl_settings_routed:.3g} against {kl_quant_routed:.3g} on the {int(routed.sum())} rows routed " \
            f"decisively, and are less accurate: KL(f16 || extra) {kl_extra:.3g} against KL(f16 || plain) " \
            f"{kl_quant:.3g}"
        assert flips == 0, f"{model} {qtype} {kind}: top-1 differs on {flips} decisive rows"
    measured["differences"] = result["differences"]
    record(f"extra_bufts_{model}_{qtype}", measured)
    dump_results()
    for mode, where in result["differences"].items():
        if where is not None:
            # the larger of the fixed passes' difference and that decision's own, replayed in both settings
            moved = max(max_diff, where.get("logit_diff", 0.0))
            assert where["margin"] < TIE_FACTOR * moved, \
                f"{model} {qtype} {mode}: the settings diverge at {where['at']}, where the plain model's margin " \
                f"{where['margin']:.4g} is not a near-tie (tolerance {TIE_FACTOR * moved:.3g})"
    for setting in (extra, plain):
        for mode, run in setting["modes"].items():
            assert len(run["tokens"]) == 32, (mode, len(run["tokens"]))
    used = [b for b in extra["buffer_types"] if b in ("AMX", "CPU_REPACK")]
    if cpu.read_cpuinfo().has_amx:
        record_property("note", f"extra buffer types {model} {qtype}: {', '.join(used) or 'none used'}; "
                                f"max logit diff {max_diff:.2g}")
    else:
        record_property("note", "extra buffer types: this CPU has no AMX, so the agreement test compared the "
                                "repacked layouts (CPU_REPACK) with plain buffers only")
