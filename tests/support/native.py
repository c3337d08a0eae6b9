"""Helpers for the native (patched llama.cpp) tests: availability policy, GGUF making and rewriting,
parity metrics, and a record of every measured difference (written to build/native-parity.json)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
RESULTS_FILE = REPO_ROOT / "build" / "native-parity.json"  # outside build/native, which a rebuild replaces

MEASURED: dict[str, Any] = {}


def require_native() -> None:
    """The native build (the patched llama.cpp and libclover with every clover.h prototype), for the tests marked
    ``native`` (tests/conftest.py): skipped with the reason when it is missing, a failure instead with
    CLOVER_REQUIRE_NATIVE=1 (CI). CLOVER_SKIP_NATIVE=1 (`make test-fast`) skips every native test, built or not."""
    if os.environ.get("CLOVER_SKIP_NATIVE") == "1" and os.environ.get("CLOVER_REQUIRE_NATIVE") != "1":
        pytest.skip("CLOVER_SKIP_NATIVE=1: the pure-Python tests only (make test-fast)")
    from clover_native import libclover, loader

    for ok, reason in (loader.native_available(), libclover.available()):
        if not ok:
            skip_or_fail(f"native runtime unavailable: {reason}")


def skip_or_fail(reason: str) -> None:
    """Fail with CLOVER_REQUIRE_NATIVE=1 (CI), otherwise skip with the reason."""
    if os.environ.get("CLOVER_REQUIRE_NATIVE") == "1":
        pytest.fail(f"CLOVER_REQUIRE_NATIVE=1 but {reason}", pytrace=False)
    pytest.skip(f"{reason} (set CLOVER_REQUIRE_NATIVE=1 to make this a failure)")


def native_tool(name: str) -> Path:
    """A tool of the native build (build/native/bin: llama-server, rpc-server, ...); skip_or_fail when missing."""
    from clover_native import loader

    path = loader.lib_dir().parent / "bin" / name
    if not path.exists():
        skip_or_fail(f"{path} is missing (scripts/build_native.sh builds it)")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds (servers started by tests)."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def record(name: str, value: Any) -> None:
    MEASURED[name] = value


def dump_results() -> None:
    if not MEASURED:
        return
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    old: dict[str, Any] = {}
    if RESULTS_FILE.exists():
        try:
            old = json.loads(RESULTS_FILE.read_text())
        except ValueError:
            old = {}
    old.update(MEASURED)
    RESULTS_FILE.write_text(json.dumps(old, indent=1, sort_keys=True))


def clover_convert(model_dir: Path, out: Path, outtype: str = "f32", *options: str) -> Path:
    """clover-convert (our converter) in a subprocess; ``options`` are more of its flags."""
    done = subprocess.run([str(VENV_PYTHON), "-m", "clover_convert", str(model_dir), "--outfile", str(out),
                           "--outtype", outtype, *options], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def quantize(src: Path, dst: Path, qtype: str = "Q8_0") -> Path:
    from clover_native import loader

    tool = loader.lib_dir().parent / "bin" / "llama-quantize"
    assert tool.exists(), f"{tool} missing (make native)"
    done = subprocess.run([str(tool), str(src), str(dst), qtype], capture_output=True, text=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return dst


def parity(native_logits: np.ndarray, ref_logits: np.ndarray, rel: float) -> dict[str, float]:
    """Max |diff|, the tolerance rel * max(1, max|ref|), and top-1 mismatches where the ref's top-2 gap > tol."""
    a = np.asarray(native_logits, dtype=np.float64)
    b = np.asarray(ref_logits, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = float(np.abs(a - b).max())
    scale = max(1.0, float(np.abs(b).max()))
    tol = rel * scale
    top2 = np.sort(b, axis=-1)[..., -2:]
    gap = top2[..., 1] - top2[..., 0]
    decisive = gap > tol
    mism = int(((a.argmax(-1) != b.argmax(-1)) & decisive).sum())
    return {"max_abs_diff": diff, "max_abs_ref": float(np.abs(b).max()), "tol": tol, "rel": diff / scale,
            "top1_mismatch_decisive": mism, "rows": int(a.shape[0])}


def assert_parity(name: str, native_logits: np.ndarray, ref_logits: np.ndarray, rel: float) -> dict[str, float]:
    m = parity(native_logits, ref_logits, rel)
    record(name, m)
    assert m["max_abs_diff"] <= m["tol"], f"{name}: max|diff| {m['max_abs_diff']:.3g} > tol {m['tol']:.3g}"
    assert m["top1_mismatch_decisive"] == 0, f"{name}: top-1 differs on {m['top1_mismatch_decisive']} rows"
    return m


# ------------------------------------------------------------------------------------------ GGUF rewrite
def rewrite_gguf(src: Path, dst: Path, *, kv: dict[str, Any] | None = None,
                 drop_tensors: Iterable[str] = (),
                 tensor_edit: Callable[[str, np.ndarray], np.ndarray] | None = None, arch: str | None = None,
                 add_kv: dict[str, tuple[Any, Any]] | None = None) -> Path:
    """Copy a GGUF with some keys changed (kv: name -> new value, same type) or tensors dropped/edited; ``arch``
    renames the architecture and its key prefix; ``add_kv`` (name -> (value, GGUFValueType)) adds keys."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    old_arch = reader.fields["general.architecture"].contents()
    arch = arch or old_arch
    writer = gguf.GGUFWriter(str(dst), arch)
    kv = dict(kv or {})
    drop = set(drop_tensors)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name.startswith(old_arch + "."):
            name = arch + name[len(old_arch):]
        vtype = field.types[0]
        value = kv.pop(name, None)
        if value is None:
            value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, vtype)
    assert not kv, f"keys not in {src}: {sorted(kv)}"
    for name, (value, vtype) in (add_kv or {}).items():
        writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        if t.name in drop:
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, "rewrite_gguf copies F32 files only"
        data = np.array(t.data, dtype=np.float32).reshape([int(x) for x in reversed(t.shape.tolist())])
        if tensor_edit is not None:
            data = tensor_edit(t.name, data)
        writer.add_tensor(t.name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def load_in_subprocess(path: Path) -> subprocess.CompletedProcess[str]:
    """Try to load a GGUF in a fresh interpreter (a crash there cannot take the test session down)."""
    code = (
        "import sys\n"
        "from clover_native import loader, bindings\n"
        "try:\n"
        "    bindings.LlamaModel(sys.argv[1])\n"
        "except loader.NativeError as exc:\n"
        "    print('LOAD-ERROR:', exc)\n"
        "    sys.exit(3)\n"
        "print('LOADED')\n"
    )
    env = dict(os.environ, CLOVER_NATIVE_QUIET="1")
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                          cwd=str(REPO_ROOT), timeout=300)


Windows = list[tuple[int, list[int]]]  # (segment boundary p, masked rows of the window starting at p)


def causal_and_block_logits(path: Path, docs: list[tuple[list[int], Windows]], window: int,
                            use_extra_bufts: bool = True, router: Any = None,
                            bd_path: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """For each (tokens, windows) document, on a fresh history: the causal logits of every position (the
    tokens appended segment by segment) and, at each boundary p, the block logits of the masked rows of
    the window tokens[p:p+window] over the history tokens[:p]. Rows of all documents, concatenated.
    ``use_extra_bufts=False`` loads the weights without AMX or repacked layouts. ``router``: a
    routing_support.NativeRouterMargins that collects the native routing margins of the same rows. ``bd_path``: a
    block-diffusion sidecar for a trunk-only ``path``."""
    from clover_native import bindings

    model = bindings.LlamaModel(path, use_extra_bufts=use_extra_bufts, bd_path=bd_path)
    ctx = bindings.Context(model, n_ctx=1024, n_ubatch=64, n_batch=512,
                                eval_callback=router.eval_callback if router else None)
    mask = model.mask_token()
    causal, block = [], []

    def run_causal(ids: list[int]) -> None:
        causal.append(ctx.causal(ids))
        if router:
            router.end_pass("causal", len(ids))

    try:
        for tokens, windows in docs:
            ctx.clear()
            done = 0
            for p, masked in windows:
                run_causal(tokens[done:p])
                done = p
                canvas = [mask if j in masked else t for j, t in enumerate(tokens[p:p + window])]
                block.append(ctx.block(canvas, rows=masked))
                if router:
                    router.end_pass("block", len(canvas), masked)
            run_causal(tokens[done:])
        return np.concatenate(causal), np.concatenate(block)
    finally:
        ctx.close()
        model.close()


def block_window(ids: list[int], p: int, b: int, canvas: str, mask: int) -> list[int]:
    """The window at p of the parity tests: seed ids[p], then B-1 canvas slots (``masked``: all mask;
    ``filled``: the true tokens; ``partly``: every other one masked)."""
    known = ids[p + 1:p + b]
    if canvas == "masked":
        rest = [mask] * (b - 1)
    elif canvas == "filled":
        rest = list(known)
    else:
        rest = [t if i % 2 == 0 else mask for i, t in enumerate(known)]
    return [ids[p]] + rest


def kl_top1(ref: np.ndarray, q: np.ndarray) -> tuple[float, float]:
    """Mean KL(softmax(ref) || softmax(q)) over rows, and the share of rows with the same argmax."""
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref), log_softmax(q)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean()), float((ref.argmax(-1) == q.argmax(-1)).mean())
