#!/usr/bin/env python3
"""Benchmark clover-convert against llama.cpp's convert_hf_to_gguf.py (issue 3). Not a unit test.

    .venv/bin/python bench/bench_convert.py [--layers 2] [--workdir build/bench-convert] [--keep]

1. Streams a random ``35b-shape --layers N`` checkpoint (real 35B-A3B layer dims: 256 experts, vocab
   248320; about 5.3 GB in BF16 for N = 2) to disk, with the Clover tensors in a shard of their own.
2. Builds its plain Qwen3.5-MoE twin (the other shards, symlinked, and a qwen3_5_moe_text config).
3. For bf16 and q8_0: converts the checkpoint with clover-convert and the twin with the vendored
   converter, recording wall time and peak RSS of each, and checks that every tensor the two share is
   byte-identical (ssm_a within one ULP).
4. Reports the full 35B sizes from ``clover-convert --dry-run`` on a config-only 35b-shape directory.

Results go to bench/results/bench_convert.json and bench/results/bench_convert.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

from clover_ref.config import CLOVER_FIELDS
from clover_ref.factory import init_checkpoint, init_checkpoint_streaming
from clover_ref.tokenizer import SHIPPED_FILES

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
RESULTS = REPO / "bench" / "results"
# Runs a command as the only child of a small Python process, which prints the child's wall time and peak
# RSS. (A child forked from this process directly would count this process's pages in its ru_maxrss.)
MEASURE = """
import resource, subprocess, sys, time
start = time.perf_counter()
rc = subprocess.call(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=open(sys.argv[1], "w"))
wall = time.perf_counter() - start
print(wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(rc)
"""


def measure(command: list[str], log: Path) -> dict[str, float]:
    done = subprocess.run([PYTHON, "-c", MEASURE, str(log), *command], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"command failed ({done.returncode}): {' '.join(command)}\n{log.read_text()[-3000:]}")
    wall, rss = done.stdout.split()
    return {"wall_s": round(float(wall), 2), "peak_rss_mib": round(int(rss) / 2**20, 1)}


def make_checkpoints(workdir: Path, layers: int) -> tuple[Path, Path]:
    name = f"clover-35b-shape-{layers}L"
    model = workdir / "clover" / name
    twin = workdir / "twin" / name
    if not (model / "config.json").exists():
        print(f"writing {model} ...", flush=True)
        start = time.perf_counter()
        init_checkpoint_streaming(model, "35b-shape", seed=0, layers=layers, max_shard_bytes=4 * 10**9,
                                  separate_clover_shard=True)
        print(f"  {time.perf_counter() - start:.0f} s", flush=True)
    if twin.exists():
        shutil.rmtree(twin)
    twin.mkdir(parents=True)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    clover_shard = sorted(set(index["weight_map"].values()))[-1]
    weight_map = {n: f for n, f in index["weight_map"].items() if f != clover_shard}
    for file_name in sorted(set(weight_map.values())):
        (twin / file_name).symlink_to(model / file_name)
    (twin / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((model / "config.json").read_text())
    for key in CLOVER_FIELDS:
        config.pop(key, None)
    config.update(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"])
    (twin / "config.json").write_text(json.dumps(config, indent=2))
    for file_name in SHIPPED_FILES:
        shutil.copy(model / file_name, twin / file_name)
    return model, twin


def compare(ours: Path, theirs: Path) -> dict[str, object]:
    """Byte equality of every tensor the vendored file has (ssm_a: at most one ULP)."""
    our_tensors = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    different, ulp = [], 0
    their_tensors = gguf.GGUFReader(theirs).tensors
    for t in their_tensors:
        a, b = np.asarray(our_tensors[t.name].data), np.asarray(t.data)
        if t.name.endswith("ssm_a"):
            diff = np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32))
            ulp = max(ulp, int(diff.max()))
        elif our_tensors[t.name].tensor_type != t.tensor_type or a.tobytes() != b.tobytes():
            different.append(t.name)
    return {"tensors_compared": len(their_tensors), "different": different, "ssm_a_max_ulp": ulp}


def full_35b_sizes(workdir: Path) -> dict[str, int]:
    config_only = workdir / "clover-35b-config-only"
    init_checkpoint(config_only, "35b-shape", config_only=True)
    sizes = {}
    for outtype in ("bf16", "q8_0"):
        out = subprocess.run([PYTHON, "-m", "clover_convert", str(config_only), "--dry-run", "--outtype", outtype],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        sizes[outtype] = int(out[-2].split()[2].replace(",", ""))
    return sizes


def markdown(result: dict) -> str:
    lines = [
        "# clover-convert benchmark",
        "",
        f"Checkpoint: `35b-shape --layers {result['layers']}` (real Qwen3.5-35B-A3B layer dims, 256 experts, "
        f"vocab 248320), {result['checkpoint_bytes'] / 1e9:.2f} GB BF16 safetensors. "
        f"Machine: {result['machine']}. clover-convert --threads {result['threads']}.",
        "",
        "| outtype | converter | wall time (s) | peak RSS (MiB) | output (GB) | load avg before |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for run in result["runs"]:
        lines.append(f"| {run['outtype']} | {run['converter']} | {run['wall_s']:.1f} | {run['peak_rss_mib']:.0f} | "
                     f"{run['output_bytes'] / 1e9:.2f} | {run['load_avg_1m_before']:.1f} |")
    lines += ["", "Equality with the vendored converter (tensors it writes; ssm_a allowed one ULP):", ""]
    for outtype, check in result["equality"].items():
        status = "all byte-identical" if not check["different"] else f"DIFFERENT: {check['different'][:5]}"
        lines.append(f"- {outtype}: {check['tensors_compared']} tensors, {status}, ssm_a max "
                     f"{check['ssm_a_max_ulp']} ULP")
    sizes = result["full_35b_dry_run_bytes"]
    lines += ["", "Full 35B (`clover-convert --dry-run` on `35b-shape --config-only`): "
              f"bf16 {sizes['bf16']:,d} bytes ({sizes['bf16'] / 2**30:.2f} GiB), "
              f"q8_0 {sizes['q8_0']:,d} bytes ({sizes['q8_0'] / 2**30:.2f} GiB).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-convert")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and outputs")
    args = parser.parse_args()
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model, twin = make_checkpoints(workdir, args.layers)
    checkpoint_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    tree = subprocess.run([PYTHON, str(REPO / "scripts" / "llama_sdist.py"), "unpack"], capture_output=True,
                          text=True, check=True).stdout.split()[-1]
    vendored_tree = Path(tree) / "vendor" / "llama.cpp"
    runs, equality = [], {}
    for outtype in ("bf16", "q8_0"):
        ours, theirs = workdir / f"clover-{outtype}.gguf", workdir / f"qwen35moe-{outtype}.gguf"
        commands = {
            "clover-convert": [PYTHON, "-m", "clover_convert", str(model), "--outfile", str(ours), "--outtype",
                               outtype, "--threads", str(args.threads)],
            "vendored convert_hf_to_gguf.py": [PYTHON, str(REPO / "scripts" / "vendored_convert.py"), str(twin),
                                               "--outfile", str(theirs), "--outtype", outtype, "--tree",
                                               str(vendored_tree)],
        }
        for converter, command in commands.items():
            print(f"{outtype}: {converter} ...", flush=True)
            path = ours if converter == "clover-convert" else theirs
            load = os.getloadavg()[0]  # other work on the machine skews wall times; record it
            stats = measure(command, workdir / f"{path.stem}.log")
            runs.append({"outtype": outtype, "converter": converter, **stats, "output_bytes": path.stat().st_size,
                         "load_avg_1m_before": round(load, 2)})
            print(f"  {stats}", flush=True)
        equality[outtype] = compare(ours, theirs)
        print(f"  equality: {equality[outtype]}", flush=True)
        if not args.keep:
            ours.unlink()
            theirs.unlink()
    result = {
        "layers": args.layers, "checkpoint_bytes": checkpoint_bytes, "threads": args.threads,
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}",
        "runs": runs, "equality": equality, "full_35b_dry_run_bytes": full_35b_sizes(workdir),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_convert.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "bench_convert.md").write_text(markdown(result))
    print(markdown(result))
    if not args.keep:
        shutil.rmtree(workdir / "clover")
        shutil.rmtree(workdir / "twin")


if __name__ == "__main__":
    main()
