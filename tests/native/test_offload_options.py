"""llama.cpp's offload options in the engine and clover-cpp (docs/native.md, "A 35B on one 24 GB GPU").

-ot/--override-tensor, --cpu-moe, --n-cpu-moe, -sm/--split-mode, -mg/--main-gpu, -ts/--tensor-split and
--fit-target: the CLI flags reach clover_engine_params and, through libclover, llama_model_params; --n-cpu-moe's
patterns are llama.cpp's; a real CPU load with experts forced to plain CPU buffers decodes the same tokens; options
that cannot be satisfied and plans that do not fit are refused at load with a message naming them. All on CPU.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clover_dev import REPO_ROOT
from clover_dev.convert import clover_convert

from clover_native import libclover
from clover_cpp.cli import build_parser
from clover_cpp.options import model_kwargs
from clover_cpp.offload import LLM_FFN_EXPS_REGEX, Offload, device_bytes, ffn_exps_block_regex
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native  # every test here runs the native build (skipped without it; a failure in CI)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    """tiny f32: 4 layers (3 GDN + 1 attention), 8 experts top-2."""
    return clover_convert(tiny_checkpoint, module_tmp("offload") / "tiny-f32.gguf", "f32")


def _describe(path: Path, **model_args: Any) -> dict[str, Any]:
    from clover_cpp.model import engine_params

    params, keep = engine_params(**model_args)
    desc = libclover.describe_offload(str(path), params)
    del keep
    return desc


def _c_string(header: str, name: str) -> str:
    m = re.search(rf'{name}\s*=\s*"((?:[^"\\]|\\.)*)"', header)
    assert m, f"{name} not found in llama.cpp's common/common.h"
    return m.group(1).encode().decode("unicode_escape")


# ------------------------------------------------------------------------------- --n-cpu-moe is llama.cpp's
def test_n_cpu_moe_patterns_are_llamas(tiny_gguf: Path) -> None:
    """The patterns libclover hands to llama.cpp for --n-cpu-moe / --cpu-moe are llama.cpp's own
    (LLM_FFN_EXPS_REGEX and llm_ffn_block_regex in the pinned tree's common/common.h)."""
    from clover_native import cpu, loader

    info = cpu.read_build_info(loader.lib_dir().parent)
    header = (Path(info["build_dir"]).parent / "src" / "common" / "common.h").read_text()
    assert _c_string(header, "LLM_FFN_EXPS_REGEX") == LLM_FFN_EXPS_REGEX
    assert re.search(r'string_format\("blk\\\\.%d%s", idx, ffn_regex\)', header), "llm_ffn_block_regex changed"
    for n in (1, 3, 4):
        desc = _describe(tiny_gguf, offload=Offload(n_cpu_moe=n))
        assert desc["overrides"] == [(ffn_exps_block_regex(i), "CPU") for i in range(n)]
        assert desc["overrides"][0][0] == r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps"
    assert _describe(tiny_gguf, offload=Offload(cpu_moe=True))["overrides"] == [(LLM_FFN_EXPS_REGEX, "CPU")]
    # -ot first, then --cpu-moe / --n-cpu-moe: llama.cpp takes the first pattern that matches
    desc = _describe(tiny_gguf, offload=Offload(override_tensor="attn_.*=CPU,output=CPU", n_cpu_moe=1))
    assert desc["overrides"] == [("attn_.*", "CPU"), ("output", "CPU"), (ffn_exps_block_regex(0), "CPU")]


# ------------------------------------------------------------------------------- CLI -> engine params
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_cli_flags_reach_model_params(command: str, tiny_gguf: Path) -> None:
    extra = ["-p", "x"] if command == "generate" else []
    parser = build_parser()
    args = parser.parse_args([command, "-m", str(tiny_gguf), *extra, "-ngl", "3", "-ot", "ffn_up_exps=CPU",
                              "--override-tensor", "ffn_down_exps=CPU", "-ncmoe", "2", "-sm", "none", "-mg", "0",
                              "-fitt", "512"])
    kwargs = model_kwargs(args)
    off = kwargs["offload"]
    assert off == Offload(override_tensor="ffn_up_exps=CPU,ffn_down_exps=CPU", n_cpu_moe=2, split_mode="none",
                          main_gpu=0, fit_target_mib=512)
    from clover_cpp.model import engine_params

    params, keep = engine_params(**kwargs)
    assert (params.n_gpu_layers, params.n_cpu_moe, params.cpu_moe, params.split_mode, params.main_gpu,
            params.fit_margin_mib) == (3, 2, False, 0, 0, 512)
    assert params.override_tensor == b"ffn_up_exps=CPU,ffn_down_exps=CPU" and params.tensor_split is None
    desc = libclover.describe_offload(str(tiny_gguf), params)
    assert desc["n_gpu_layers"] == 3 and desc["split_mode"] == 0 and desc["main_gpu"] == 0
    assert desc["tensor_split"] == []
    assert desc["overrides"] == [("ffn_up_exps", "CPU"), ("ffn_down_exps", "CPU"),
                                 (ffn_exps_block_regex(0), "CPU"), (ffn_exps_block_regex(1), "CPU")]
    del keep

    args = parser.parse_args([command, "-m", str(tiny_gguf), *extra, "--cpu-moe", "--split-mode", "row",
                              "--tensor-split", "3,1", "--main-gpu", "1"])
    params, keep = engine_params(**model_kwargs(args))
    assert params.cpu_moe and params.split_mode == 2 and params.main_gpu == 1 and params.tensor_split == b"3,1"
    defaults, _ = engine_params(**model_kwargs(parser.parse_args([command, "-m", str(tiny_gguf), *extra])))
    assert (defaults.override_tensor, defaults.n_cpu_moe, defaults.cpu_moe, defaults.split_mode, defaults.main_gpu,
            defaults.tensor_split, defaults.fit_margin_mib) == (None, 0, False, -1, 0, None, 1024)
    assert libclover.lib().clover_engine_default_params().split_mode == -1


# ------------------------------------------------------------------------------- real loads on the CPU
def _load_log(gguf: Path, offload: Offload | None) -> tuple[list[int], list[str]]:
    from clover_native import loader
    from clover_cpp.model import Model

    lines: list[str] = []
    with loader.log_listener(lambda _level, line: lines.append(line)):
        with Model(gguf, n_threads=2, offload=offload) as m:
            ids = m.tokenize("def fibonacci(n):")
            tokens = m.generate(ids, mode="ar", max_tokens=24).wait()
    overridden = sorted(re.search(r"tensor (\S+) ", ln).group(1) for ln in lines  # type: ignore[union-attr]
                        if "buffer type overridden to" in ln)
    return tokens, overridden


def test_load_with_experts_on_cpu_gives_the_same_tokens(tiny_gguf: Path) -> None:
    """-ot exps=CPU (and --n-cpu-moe 2) on the real tiny model: llama.cpp applies the overrides to exactly the
    expert tensors the planner (device_bytes) puts there, and greedy ar decoding gives the same tokens."""
    import gguf

    base, none = _load_log(tiny_gguf, None)
    assert none == []
    names = [t.name for t in gguf.GGUFReader(str(tiny_gguf)).tensors]
    exps = sorted(n for n in names if re.search(r"ffn_(up|down|gate)_exps", n))
    assert len(exps) == 12

    tokens, overridden = _load_log(tiny_gguf, Offload(override_tensor="exps=CPU"))
    assert tokens == base
    assert overridden == exps

    tokens, overridden = _load_log(tiny_gguf, Offload(n_cpu_moe=2))
    assert tokens == base
    assert overridden == sorted(n for n in exps if n.startswith(("blk.0.", "blk.1.")))
    # the planner agrees with llama.cpp on which tensors the overrides move
    sizes = [(n, 1) for n in names]
    plan = device_bytes(sizes, n_layer=4, n_gpu_layers=99, overrides=Offload(n_cpu_moe=2).overrides(4))
    assert plan["CPU"] == len(overridden) + 1  # + token_embd, which llama.cpp keeps on the CPU
    assert plan["GPU"] == len(names) - plan["CPU"]


@pytest.mark.parametrize("offload,needle", [
    (Offload(override_tensor="exps=CUDA0"), "unknown buffer type 'CUDA0' (available: CPU"),
    (Offload(override_tensor="exps"), "'exps' is not <tensor name regex>=<buffer type>"),
    (Offload(override_tensor="blk.(0=CPU"), "'blk.(0' is not a valid regex"),
    (Offload(n_cpu_moe=-1), "n_cpu_moe (--n-cpu-moe) must be >= 0"),
    (Offload(n_cpu_moe=5), "n_cpu_moe (--n-cpu-moe) 5 exceeds the model's 4 layers"),
    (Offload(tensor_split="3,1"), "tensor_split (-ts) '3,1' has 2 entries, but this build has 0 GPU devices"),
    (Offload(tensor_split="1,x"), "'x' is not a proportion"),
    (Offload(main_gpu=1), "main_gpu (-mg) 1: this build has 0 GPU devices"),
])
def test_bad_options_are_refused_at_load(tiny_gguf: Path, offload: Offload, needle: str) -> None:
    """On this CPU-only build: each option that cannot be satisfied fails the real load, naming the option."""
    from clover_cpp.model import EngineError, Model

    with pytest.raises(EngineError) as exc:
        Model(tiny_gguf, n_gpu_layers=99, offload=offload)
    assert needle in str(exc.value)


def test_unknown_split_mode_is_refused(tiny_gguf: Path) -> None:
    from clover_cpp.model import engine_params
    from clover_native.loader import NativeError

    with pytest.raises(ValueError, match="split-mode"):
        engine_params(offload=Offload(split_mode="tensor"))
    params, keep = engine_params()
    params.split_mode = 3  # LLAMA_SPLIT_MODE_TENSOR, straight into the C struct
    with pytest.raises(NativeError, match=r"split_mode \(-sm\) 3 is not one of none \(0\), layer \(1\), row \(2\)"):
        libclover.describe_offload(str(tiny_gguf), params)
    del keep


# ------------------------------------------------------------------------------- the memory plan and its check
def test_memory_plan_and_fit_check(tiny_gguf: Path) -> None:
    """clover_engine_plan_memory is llama.cpp's no_alloc dry run: on this CPU build one host entry whose weights
    are the file's tensor bytes. clover_check_fit (what clover_engine_load applies with layers on a GPU) refuses
    a device too small for its share, with the numbers, and ignores host memory (the weights are mmapped)."""
    import gguf

    from clover_cpp.model import engine_params

    params, keep = engine_params()
    devs = libclover.plan_memory(str(tiny_gguf), params)
    assert len(devs) == 1 and devs[0]["is_host"] and devs[0]["name"] == "Host"
    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(tiny_gguf)).tensors)
    assert abs(devs[0]["model"] - tensor_bytes) <= 64 * 1024, (devs[0]["model"], tensor_bytes)
    assert devs[0]["context"] > 0 and devs[0]["compute"] > 0
    assert libclover.check_fit(devs, 1024) == ""  # host memory is not checked

    mib = 2**20
    fake = {"name": "CUDA0", "total": 24_000 * mib, "free": 23_600 * mib, "model": 21_000 * mib,
            "context": 1_600 * mib, "compute": 500 * mib}
    msg = libclover.check_fit([fake, devs[0]], 1024)
    assert msg.startswith("the model does not fit: needs 23100 MiB on CUDA0 (weights 21000, context 1600, "
                          "compute 500 MiB), 23.0 GiB free, 1024 MiB of it kept free"), msg
    assert libclover.check_fit([fake, devs[0]], 0) == ""  # 23100 <= 23600
    assert libclover.check_fit([dict(fake, free=0, total=0)], 1024) == ""  # a device that reports nothing
    two = libclover.check_fit([fake, dict(fake, name="CUDA1", model=10 * mib)], 1024)
    assert "CUDA0" in two and "CUDA1" not in two
    del keep


def test_device_bytes_follows_llamas_layer_rule() -> None:
    """llama_model_base::load_tensors: the last n_gpu_layers of the n_layer + 1 layers (output last) on the GPU,
    the input layer always on the CPU, then the first matching override."""
    tensors = [("token_embd.weight", 1), ("output.weight", 10), ("output_norm.weight", 100)]
    tensors += [(f"blk.{i}.{k}", 1000 * 10**i) for i in range(3) for k in ("attn_norm.weight", "ffn_up_exps.weight")]
    assert device_bytes(tensors, 3, 0, []) == {"CPU": sum(b for _, b in tensors), "GPU": 0}
    # -ngl counts the output layer: -ngl 1 offloads only it, -ngl n_layer all but layer 0
    assert device_bytes(tensors, 3, 1, []) == {"CPU": 1 + 2 * 111000, "GPU": 110}
    assert device_bytes(tensors, 3, 3, []) == {"CPU": 1 + 2 * 1000, "GPU": 110 + 2 * 110000}
    assert device_bytes(tensors, 3, -1, []) == {"CPU": 1, "GPU": 110 + 2 * 111000}
    moe = Offload(n_cpu_moe=2).overrides(3)
    assert device_bytes(tensors, 3, 99, moe) == {"CPU": 1 + 11000, "GPU": 110 + 2 * 111000 - 11000}
    assert device_bytes(tensors, 3, 99, Offload(override_tensor="token_embd=CUDA0").overrides(3))["CPU"] == 0


# ------------------------------------------------------------------------------- the CLI's one-line errors
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    # python -m from the repository root, so this checkout's clover_cpp is the one that runs
    return subprocess.run([sys.executable, "-m", "clover_cpp.cli", *args], capture_output=True, text=True,
                          cwd=str(REPO_ROOT), timeout=300)


@pytest.mark.parametrize("flags,needle", [
    (["--n-cpu-moe", "9"], "--n-cpu-moe) 9 exceeds the model's 4 layers"),
    (["-ncmoe", "-1"], "-ncmoe/--n-cpu-moe must be >= 0"),
    (["-ot", "exps=GPU9"], "unknown buffer type 'GPU9'"),
    (["-ot", "exps"], "is not <tensor name regex>=<buffer type>"),
    (["-ngl", "99", "-ts", "1,1"], "tensor_split (-ts) '1,1' has 2 entries, but this build has 0 GPU devices"),
    (["-sm", "tensor"], "argument -sm/--split-mode: invalid choice"),
    (["-mg", "2"], "main_gpu (-mg) 2"),
])
def test_cli_bad_offload_flags(tiny_gguf: Path, flags: list[str], needle: str) -> None:
    done = _cli("generate", "-m", str(tiny_gguf), "-p", "x", "-n", "1", *flags)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clover-cpp: error:"), done.stderr
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize("value", [2**31, 2**32 - 1])
def test_a_layer_count_out_of_range_is_named_not_called_missing(tiny_gguf: Path, tmp_path: Path, value: int) -> None:
    """The offload plan reads block_count before llama.cpp's loader (clover-gguf.cpp, clover_gguf_n_layer): a
    count that does not fit an int32 is refused with its value, never reported as a missing key."""
    from tests.support.fuzz_gguf import parse, serialize

    gguf = parse(tiny_gguf.read_bytes())
    (kv,) = [kv for kv in gguf.kvs if kv.key == "clover_moe.block_count"]
    kv.value = value
    path = tmp_path / "layers.gguf"
    path.write_bytes(serialize(gguf))
    done = _cli("generate", "-m", str(path), "-p", "x", "-n", "1")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr)
    assert f"clover_moe.block_count = {value}" in lines[0] and "missing" not in lines[0], lines[0]


def test_cli_generate_with_experts_on_cpu(tiny_gguf: Path) -> None:
    import json

    runs = [json.loads(_cli("generate", "-m", str(tiny_gguf), "-p", "def f(x):", "--mode", "ar", "-n", "12",
                            "--json", *flags).stdout)["tokens"] for flags in ([], ["-ot", "exps=CPU"], ["-ncmoe", "4"])]
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 12
