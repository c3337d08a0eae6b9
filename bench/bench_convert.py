#!/usr/bin/env python3
"""Benchmark clover-convert against llama.cpp's convert_hf_to_gguf.py. Not a unit test.

    .venv/bin/python -m bench.bench_convert [--layers 2] [--workdir build/bench-convert] [--keep] [--onepass]

1. Streams a random ``35b-shape --layers N`` checkpoint (real 35B-A3B layer dims: 256 experts, vocab
   248320; about 5.3 GB in BF16 for N = 2) to disk, with the Clover tensors in a shard of their own.
2. Builds its plain Qwen3.5-MoE twin (the other shards, symlinked, and a qwen3_5_moe_text config).
3. For bf16 and q8_0: converts the checkpoint with clover-convert and the twin with the vendored
   converter, recording wall time and peak RSS of each, and checks that every tensor the two share is
   byte-identical (ssm_a within one ULP).
4. Reports the full 35B sizes from ``clover-convert --dry-run`` on a config-only 35b-shape directory.

Results go to bench/results/bench_convert.json and bench/results/bench_convert.md.

With --onepass it instead compares three routes to Q4_K_M, side by side in one run, each timed with its
wall time, peak RSS and peak disk beyond the inputs (allocated blocks of the output folder, sampled every
50 ms): one-pass `clover-convert --outtype Q4_K_M`; `clover-convert --outtype bf16` then `clover-quantize`;
and llama.cpp's own two steps on the twin (the vendored converter, then llama-quantize). The one-pass run is
repeated with 1..N threads (the time split between reading, converting, quantizing and writing comes from
the converter, CLOVER_CONVERT_TIMINGS), the one-pass file is checked against the two-step one (every tensor
and key but general.quantized_by), and all is extrapolated to the full 40 layers in proportion to the BF16
bytes (bench/results/plan_35b.json gives the full Q4_K_M size). Results: bench_convert_onepass.{json,md}.
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

from clover_common.config import qwen_twin_config
from clover_ref.factory import init_checkpoint, init_checkpoint_streaming
from clover_common.tokenizer import SHIPPED_FILES

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
RESULTS = REPO / "bench" / "results"
# Runs a command as the only child of a small Python process, which prints the child's wall time and peak
# RSS. (A child forked from this process directly would count this process's pages in its ru_maxrss.)
# With a folder to watch (argv[2], "" for none), it also samples the disk that folder's files occupy
# (allocated blocks, so a sparse file counts what it really uses) every 50 ms and prints the peak growth.
MEASURE = """
import os, resource, subprocess, sys, threading, time
def used(folder):
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total
watch = sys.argv[2]
base = used(watch) if watch else 0
peak = [base]
done = threading.Event()
def sample():
    while not done.wait(0.05):
        peak[0] = max(peak[0], used(watch))
if watch:
    threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
rc = subprocess.call(sys.argv[3:], stdout=subprocess.DEVNULL, stderr=open(sys.argv[1], "w"))
wall = time.perf_counter() - start
done.set()
if watch:
    peak[0] = max(peak[0], used(watch))
print(wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, peak[0] - base)
sys.exit(rc)
"""


def measure(command: list[str], log: Path, watch: Path | None = None,
            env: dict[str, str] | None = None) -> dict[str, float]:
    done = subprocess.run([PYTHON, "-c", MEASURE, str(log), str(watch or ""), *command], capture_output=True,
                          text=True, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"command failed ({done.returncode}): {' '.join(command)}\n{log.read_text()[-3000:]}")
    wall, rss, disk = done.stdout.split()
    stats = {"wall_s": round(float(wall), 2), "peak_rss_mib": round(int(rss) / 2**20, 1)}
    if watch is not None:
        stats["peak_extra_disk_bytes"] = int(disk)
    return stats


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
    config = qwen_twin_config(json.loads((model / "config.json").read_text()))
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


def _same_quantized_file(a: Path, b: Path) -> dict[str, object]:
    """Every tensor (type and bytes) and every key but general.quantized_by equal."""
    ra, rb = gguf.GGUFReader(a), gguf.GGUFReader(b)
    skip = "general.quantized_by"
    kv_a = {k: [bytes(f.parts[i]) for i in f.data] for k, f in ra.fields.items() if k != skip}
    kv_b = {k: [bytes(f.parts[i]) for i in f.data] for k, f in rb.fields.items() if k != skip}
    different = [x.name for x, y in zip(ra.tensors, rb.tensors)
                 if x.name != y.name or x.tensor_type != y.tensor_type or x.data.tobytes() != y.data.tobytes()]
    return {"tensors": len(ra.tensors), "same_tensor_count": len(ra.tensors) == len(rb.tensors),
            "keys_equal": list(kv_a.items()) == list(kv_b.items()), "different_tensors": different}


def bench_onepass(workdir: Path, model: Path, twin: Path, vendored_tree: Path, threads: list[int],
                  checkpoint_bytes: int, layers: int) -> dict:
    out = workdir / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    runs: dict[str, dict] = {}

    def run(key: str, command: list[str], env: dict[str, str] | None = None) -> dict:
        print(f"{key} ...", flush=True)
        load = os.getloadavg()[0]
        stats = measure(command, workdir / f"{key}.log", watch=out, env=env)
        stats["load_avg_1m_before"] = round(load, 2)
        runs[key] = stats
        print(f"  {stats}", flush=True)
        return stats

    for shard in sorted(model.glob("*.safetensors")):  # the same page cache for every route: read it once
        with open(shard, "rb") as f:
            while f.read(1 << 24):
                pass
    max_threads = max(threads)
    one, kept = out / "onepass-Q4_K_M.gguf", workdir / "onepass-Q4_K_M.gguf"
    for n in sorted(threads, reverse=True):
        timings = workdir / f"timings-{n}.json"
        stats = run(f"onepass_t{n}", [PYTHON, "-m", "clover_convert", str(model), str(one), "--outtype", "Q4_K_M",
                                      "--threads", str(n)], env={"CLOVER_CONVERT_TIMINGS": str(timings)})
        stats["split_s"] = json.loads(timings.read_text())
        stats["output_bytes"] = one.stat().st_size
        one.replace(kept) if n == max_threads else one.unlink()  # kept: out of the watched folder

    bf16, two = out / "clover-bf16.gguf", out / "twostep-Q4_K_M.gguf"
    run("clover_convert_bf16", [PYTHON, "-m", "clover_convert", str(model), str(bf16), "--outtype", "bf16",
                                "--threads", str(min(2, max_threads))])
    run("clover_quantize", [PYTHON, "-m", "clover_quantize.cli", str(bf16), str(two), "Q4_K_M",
                            "--threads", str(max_threads)])
    runs["clover_quantize"]["output_bytes"] = two.stat().st_size
    identity = _same_quantized_file(kept, two)
    print(f"  identity: {identity}", flush=True)
    for p in (bf16, two, kept):
        p.unlink()

    theirs_bf16, theirs = out / "qwen35moe-bf16.gguf", out / "qwen35moe-Q4_K_M.gguf"
    run("vendored_convert_bf16", [PYTHON, str(REPO / "scripts" / "vendored_convert.py"), str(twin), "--outfile",
                                  str(theirs_bf16), "--outtype", "bf16", "--tree", str(vendored_tree)])
    quantize_tool = REPO / "build" / "native" / "bin" / "llama-quantize"
    run("llama_quantize", [str(quantize_tool), str(theirs_bf16), str(theirs), "Q4_K_M", str(max_threads)])
    runs["llama_quantize"]["output_bytes"] = theirs.stat().st_size
    for p in (theirs_bf16, theirs):
        p.unlink()

    def route(first: str | None, second: str) -> dict:
        """Two steps: times and RSS of each; the disk peak is the first step's output, kept while the second
        runs, plus the second's own peak."""
        a = runs[first] if first else {"wall_s": 0.0, "peak_rss_mib": 0.0, "peak_extra_disk_bytes": 0}
        b = runs[second]
        return {"wall_s": round(a["wall_s"] + b["wall_s"], 2),
                "peak_rss_mib": max(a["peak_rss_mib"], b["peak_rss_mib"]),
                "peak_extra_disk_bytes": a["peak_extra_disk_bytes"] + b["peak_extra_disk_bytes"],
                "quantize_step_wall_s": b["wall_s"]}

    routes = {
        "one-pass clover-convert --outtype Q4_K_M": route(None, f"onepass_t{max_threads}"),
        "clover-convert bf16 + clover-quantize": route("clover_convert_bf16", "clover_quantize"),
        "vendored convert_hf_to_gguf bf16 + llama-quantize (qwen35moe twin)": route("vendored_convert_bf16",
                                                                                  "llama_quantize"),
    }
    full = json.loads((RESULTS / "plan_35b.json").read_text())["plans"]["Q4_K_M"]
    scale = full["src_bytes"] / checkpoint_bytes
    for r in routes.values():
        r["full_35b_wall_min"] = round(r["wall_s"] * scale / 60, 1)
        r["full_35b_peak_extra_disk_gib"] = round(r["peak_extra_disk_bytes"] * scale / 2**30, 1)
    return {"layers": layers, "checkpoint_bytes": checkpoint_bytes, "threads": threads, "runs": runs,
            "routes": routes, "identity": identity, "full_35b_scale": round(scale, 2),
            "full_35b_q4_k_m_bytes": full["bytes"],
            "machine": f"{os.cpu_count()} CPUs ({_cpu_name()}), {platform.machine()}, "
                       f"Python {platform.python_version()}"}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def markdown_onepass(result: dict) -> str:
    gb = 1e9
    lines = [
        "# One pass to Q4_K_M against two steps",
        "",
        f"Checkpoint: `35b-shape --layers {result['layers']}` (real Qwen3.5-35B-A3B layer dims), "
        f"{result['checkpoint_bytes'] / gb:.2f} GB BF16 safetensors. Machine: {result['machine']}. "
        "One run, the routes one after the other; `load` is the 1-minute load average before each step "
        "(other jobs share the machine).",
        "",
        "| route | wall (s) | quantize step (s) | peak RSS (MiB) | peak extra disk (GB) | full 35B: wall (min) "
        "| full 35B: extra disk (GiB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in result["routes"].items():
        lines.append(f"| {name} | {r['wall_s']:.1f} | {r['quantize_step_wall_s']:.1f} | {r['peak_rss_mib']:.0f} | "
                     f"{r['peak_extra_disk_bytes'] / gb:.2f} | {r['full_35b_wall_min']:.1f} | "
                     f"{r['full_35b_peak_extra_disk_gib']:.1f} |")
    lines += ["", "Steps:", "", "| step | wall (s) | peak RSS (MiB) | peak extra disk (GB) | load |",
              "|---|---:|---:|---:|---:|"]
    for key, r in result["runs"].items():
        lines.append(f"| {key} | {r['wall_s']:.1f} | {r['peak_rss_mib']:.0f} | "
                     f"{r['peak_extra_disk_bytes'] / gb:.2f} | {r['load_avg_1m_before']:.1f} |")
    lines += ["", "One-pass time split by thread count (thread-seconds; reading one chunk ahead overlaps the rest; "
              "`plan` is the skeleton and llama.cpp's dry run):", "",
              "| threads | wall (s) | plan | read | convert | quantize | write |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for key, r in result["runs"].items():
        if key.startswith("onepass_t"):
            t = r["split_s"]
            lines.append(f"| {t['threads']} | {r['wall_s']:.1f} | {t['plan']:.1f} | {t['read']:.1f} | "
                         f"{t['convert']:.1f} | {t['quantize']:.1f} | {t['write']:.1f} |")
    ident = result["identity"]
    same = ident["keys_equal"] and ident["same_tensor_count"] and not ident["different_tensors"]
    lines += ["", f"One pass against clover-convert bf16 + clover-quantize: {ident['tensors']} tensors, "
              + ("every tensor and key (but general.quantized_by) identical." if same else f"DIFFERENT: {ident}"),
              "", f"Full 35B: the figures times {result['full_35b_scale']} (the BF16 bytes of 40 layers over "
              f"{result['layers']}); the Q4_K_M file is {result['full_35b_q4_k_m_bytes'] / 2**30:.2f} GiB "
              "(bench/plan_35b.py).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-convert")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and outputs")
    parser.add_argument("--onepass", action="store_true",
                        help="compare the routes to Q4_K_M instead (one pass, two steps, llama.cpp's two steps)")
    args = parser.parse_args()
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model, twin = make_checkpoints(workdir, args.layers)
    checkpoint_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    tree = subprocess.run([PYTHON, str(REPO / "scripts" / "llama_sdist.py"), "unpack"], capture_output=True,
                          text=True, check=True).stdout.split()[-1]
    vendored_tree = Path(tree) / "vendor" / "llama.cpp"
    if args.onepass:
        threads = sorted({1, os.cpu_count() or 1})
        result = bench_onepass(workdir, model, twin, vendored_tree, threads, checkpoint_bytes, args.layers)
        _save("bench_convert_onepass", result, markdown_onepass(result), workdir, args.keep)
        return
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
    _save("bench_convert", result, markdown(result), workdir, args.keep)


def _save(stem: str, result: dict, table: str, workdir: Path, keep: bool) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(table)
    print(table)
    if not keep:
        shutil.rmtree(workdir / "clover")
        shutil.rmtree(workdir / "twin")


if __name__ == "__main__":
    main()
