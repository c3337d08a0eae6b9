#!/usr/bin/env python3
"""The full-size quantization plan of Clover-35B-A3B (issue 6). Not a unit test.

    .venv/bin/python bench/plan_35b.py [--workdir build/plan-35b] [--ctx 32768] [--skip-memory]

1. Writes the 35b-shape config and tokenizer (`clover-ref init --config-only`: the real 35B-A3B dims, 40
   layers, 256 experts, vocab 248320) and, from the converter's `--dry-run --skeleton`, a bf16 GGUF with
   the real header whose 64.6 GiB of data is a sparse hole (a few MB on disk).
2. For every clover-quantize type: llama.cpp's own per-tensor plan (`clover-quantize --dry-run` on the
   skeleton) and the resulting file size; the full per-tensor Q4_K_M plan goes to a text file.
3. The memory of a context at --ctx tokens as llama.cpp allocates it for the engine (2 sequences,
   unified KV, n_rs_seq = B_max - 1) for B_max = 8, 16 and 32, read from llama.cpp's own log on the
   skeleton: KV cache, recurrent state (with the rollback snapshots) and compute buffer. Plus the weights
   of each type, that is the total a CPU-only run needs, against a 24 GB (22.35 GiB) machine.

Results: bench/results/plan_35b.md, plan_35b.json and plan_35b_q4_k_m.txt.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_K_S", "Q4_0", "IQ4_NL", "IQ4_XS"]
GIB = 2**30
MIB = 2**20
MACHINE_BYTES = 24 * 10**9


def make_skeleton(workdir: Path) -> Path:
    model_dir = workdir / "clover-35b-config"
    skeleton = workdir / "clover-35b-bf16-skeleton.gguf"
    if not skeleton.exists():
        subprocess.run([sys.executable, "-m", "clover_ref.cli", "init", str(model_dir), "--preset", "35b-shape",
                        "--config-only"], check=True)
        subprocess.run([sys.executable, "-m", "clover_convert", str(model_dir), str(skeleton), "--outtype", "bf16",
                        "--dry-run", "--skeleton"], check=True, stdout=subprocess.DEVNULL)
    return skeleton


def plans(skeleton: Path) -> dict[str, dict]:
    from clover_quantize.cli import print_plan
    from clover_quantize.inspect import read_input
    from clover_quantize.run import QuantizeOptions, plan_quantization
    from clover_quantize.types import file_type

    model = read_input(skeleton)
    out: dict[str, dict] = {}
    for name in TYPES:
        plan = plan_quantization(QuantizeOptions(input=skeleton, file_type=file_type(name), dry_run=True), model)
        out[name] = {"bytes": plan.dst_bytes, "gib": plan.dst_bytes / GIB, "bpw": plan.bits_per_weight,
                     "by_type": {k: {"tensors": n, "bytes": b} for k, (n, b) in plan.types_by_count().items()},
                     "src_bytes": plan.src_bytes, "tensors": len(plan.tensors)}
        if name == "Q4_K_M":
            buf = io.StringIO()
            print_plan(plan, buf)
            (RESULTS / "plan_35b_q4_k_m.txt").write_text(buf.getvalue())
        print(f"{name:7s} {plan.dst_bytes / GIB:7.2f} GiB {plan.bits_per_weight:5.2f} bpw", flush=True)
    return out


_SIZES = {
    "kv": re.compile(r"llama_kv_cache: size =\s+([\d.]+) MiB"),
    "rs": re.compile(r"llama_memory_recurrent: size =\s+([\d.]+) MiB"),
    "compute": re.compile(r"compute buffer size =\s+([\d.]+) MiB"),
    "output": re.compile(r"output buffer size =\s+([\d.]+) MiB"),
}


def context_memory(skeleton: Path, n_ctx: int, block_sizes: list[int]) -> dict[int, dict[str, float]]:
    """MiB of each context buffer llama.cpp allocates for the engine's context on the 35B, per B_max."""
    from clover_cpp import native

    model = native.load_model(skeleton)
    out: dict[int, dict[str, float]] = {}
    try:
        for b in block_sizes:
            lines: list[str] = []
            with native.log_listener(lambda _level, line: lines.append(line)):
                # the engine's settings (tools/clover/clover.cpp): n_ubatch = max(B + 1, 512), n_rs_seq = B - 1
                ctx = native.create_context(model, n_ctx=n_ctx, n_batch=512, n_ubatch=max(b + 1, 512),
                                            n_rs_seq=b - 1, n_threads=2)
                ctx.close()
            sizes = {k: sum(float(m.group(1)) for ln in lines for m in [rx.search(ln)] if m)
                     for k, rx in _SIZES.items()}
            out[b] = sizes
            print(f"B_max {b:2d}: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in sizes.items()), flush=True)
    finally:
        model.close()
    return out


def write_report(plan: dict[str, dict], memory: dict[int, dict[str, float]], n_ctx: int) -> None:
    lines = ["# Clover-35B-A3B: quantized sizes and memory at full size", "",
             "From `bench/plan_35b.py`: llama.cpp's own per-tensor plans (`clover-quantize --dry-run`) on a "
             "skeleton GGUF of the real 35b-shape (40 layers, 256 experts top-8 + shared, vocab 248,320; "
             "from `clover-convert --dry-run --skeleton`, bf16 source of "
             f"{plan['Q8_0']['src_bytes']:,d} bytes).", "",
             "| type | file bytes | GiB | bits/weight |", "|---|---:|---:|---:|"]
    for name, p in plan.items():
        lines.append(f"| {name} | {p['bytes']:,d} | {p['gib']:.2f} | {p['bpw']:.2f} |")
    lines += ["", "Tensor bytes only; the header adds about 6 MB (the vocabulary). The full Q4_K_M per-tensor "
              "plan is in `plan_35b_q4_k_m.txt`.", ""]
    if memory:
        lines += [f"## Memory at a {n_ctx:,d}-token context (CPU, engine settings)", "",
                  "KV cache (10 attention layers, f16), recurrent state (30 GDN layers, 2 sequences, "
                  "n_rs_seq = B_max - 1 rollback snapshots) and compute buffer, as llama.cpp allocates them; "
                  "total = Q4_K_M weights + these.", "",
                  "| B_max | KV MiB | recurrent MiB | compute MiB | context GiB | Q4_K_M total GiB | "
                  "IQ4_XS total GiB | fits 24 GB (Q4_K_M) |", "|---:|---:|---:|---:|---:|---:|---:|---|"]
        for b, m in memory.items():
            ctx_bytes = (m["kv"] + m["rs"] + m["compute"] + m["output"]) * MIB
            q4 = plan["Q4_K_M"]["bytes"] + ctx_bytes
            iq = plan["IQ4_XS"]["bytes"] + ctx_bytes
            fits = "yes" if q4 < MACHINE_BYTES * 0.9 else ("tight" if q4 < MACHINE_BYTES else "no")
            lines.append(f"| {b} | {m['kv']:.0f} | {m['rs']:.0f} | {m['compute']:.0f} | {ctx_bytes / GIB:.2f} | "
                         f"{q4 / GIB:.2f} | {iq / GIB:.2f} | {fits} |")
        lines += ["", "24 GB = 22.35 GiB, before the OS and the Python process (about 1 GiB); 'tight' means "
                  "above 90% of it. Weights are mmapped: a machine short of RAM pages them from disk "
                  "instead of failing, at a large cost in speed.", ""]
    (RESULTS / "plan_35b.md").write_text("\n".join(lines))
    (RESULTS / "plan_35b.json").write_text(json.dumps({"plans": plan, "memory_mib": memory, "n_ctx": n_ctx},
                                                      indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / "plan-35b")
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--skip-memory", action="store_true", help="only the plans (the memory step maps the "
                        "64 GiB skeleton and takes about a minute)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    skeleton = make_skeleton(args.workdir)
    plan = plans(skeleton)
    memory = {} if args.skip_memory else context_memory(skeleton, args.ctx, [8, 16, 32])
    write_report(plan, memory, args.ctx)
    print(f"wrote {RESULTS / 'plan_35b.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
