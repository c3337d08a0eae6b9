"""Helpers for the native (patched llama.cpp) tests: availability policy, GGUF rewriting, the parity assertion,
and a record of every measured difference (written to build/native-parity.json). Making GGUFs, native passes and
the metrics themselves are in clover_dev/, which the benchmarks share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clover_dev import REPO_ROOT
from clover_dev.metrics import parity

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

    path = loader.tool_path(name)
    if not path.exists():
        skip_or_fail(f"{path} is missing (scripts/build_native.sh builds it)")
    return path


@contextmanager
def llama_server(gguf: Path, *args: str, log_path: Path | None = None, ready_s: float = 120) -> Iterator[str]:
    """The native build's llama-server on ``gguf`` (clover_dev.process.llama_server), its log a new file beside the
    GGUF unless ``log_path`` says where; its base URL."""
    import tempfile

    from clover_dev.process import llama_server as start

    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log", dir=gguf.parent)
        os.close(fd)
        log_path = Path(name)
    with start(native_tool("llama-server"), gguf, *args, log_path=log_path, ready_s=ready_s) as url:
        yield url


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
