#!/usr/bin/env python3
"""The full-size quantization plan of Clover-35B-A3B (docs/quantize.md). Not a unit test.

    .venv/bin/python -m bench.plan_35b [--workdir build/plan-35b] [--ctx 32768] [--parallel N] [--skip-memory]

1. Writes the 35b-shape config and tokenizer (`clover-ref init --config-only`: the real 35B-A3B dims, 40
   layers, 256 experts, vocab 248320) and, from the converter's `--dry-run --skeleton`, a bf16 GGUF with
   the real header whose 64.6 GiB of data is a sparse hole (a few MB on disk).
2. For every clover-quantize type: llama.cpp's own per-tensor plan (`clover-quantize --dry-run` on the
   skeleton) and the resulting file size; the full per-tensor Q4_K_M plan goes to a text file.
3. The memory of a context at --ctx tokens as llama.cpp allocates it for the engine (2 sequences per slot,
   unified KV, n_rs_seq = B_max - 1) for B_max = 8, 16 and 32, read from llama.cpp's own log on the
   skeleton: KV cache, recurrent state (with the rollback snapshots) and compute buffer. Plus the weights
   of each type, that is the total a CPU-only run needs, against a 24 GB (22.35 GiB) machine.
4. A 24 GB GPU with every layer offloaded (-ngl 99) and the experts of the first N layers in host memory
   (--n-cpu-moe N), Q4_K_M: weights on each side from the per-tensor plan, placed by llama.cpp's rules
   (clover_cpp.offload.device_bytes), the context of step 3 (B_max 8) on the GPU, and the bytes that cross
   PCIe per pass (see PASS_RULE).

5. `--rpc-split`: Q8_0 across two 24 GB machines through llama.cpp's RPC backend (docs/distributed.md): -ngl 99
   with two rpc-server devices of equal free memory, placed by llama.cpp's layer split (llama_model_base::
   load_tensors: layer il of the n_layer + 1 goes to the device whose cumulative share first exceeds
   il / (n_layer + 1)), the context of step 3 (from plan_35b.json) with each layer's KV or recurrent state on its
   device. Writes bench/results/plan_35b_rpc.{md,json} only.

Results: bench/results/plan_35b.md, plan_35b.json and plan_35b_q4_k_m.txt (plan_35b_np<N>.* with --parallel N).
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

# Step 4: a "24 GB" card (RTX 3090/4090: 24,576 MiB) has about 23.6 GiB free once the CUDA context exists; less
# llama.cpp's default 1 GiB --fit-target margin (the engine's fit_margin_mib) and a desktop's few hundred MiB,
# 22.0 GiB are assumed usable for weights + context + compute (an assumption: nvidia-smi on the target card gives
# the real figure, and the engine's load check uses the device's own). PCIe 4.0 x16 is assumed to move 25 GB/s.
GPU_USABLE_GIB = 22.0
PCIE_BYTES_S = 25e9
N_CPU_MOE = [0, 4, 8, 12, 16, 24, 32, 40]
OFFLOAD_B_MAX = 8
OP_OFFLOAD_MIN_BATCH = 32  # ggml-cuda: GGML_OP_OFFLOAD_MIN_BATCH, default 32 (get_op_batch_size: MUL_MAT_ID ne[2])
PASS_RULE = (
    "With the experts of a layer in host memory, llama.cpp's scheduler runs that layer's expert mat-muls "
    "(MUL_MAT_ID) on the CPU and only activations cross PCIe: the layer's input rows to the host and its output "
    "rows back (2 x rows x n_embd x 4 bytes), plus the router's top-k ids and weights (2 x rows x top_k x 4 bytes). "
    f"When a pass has at least {OP_OFFLOAD_MIN_BATCH} rows (GGML_OP_OFFLOAD_MIN_BATCH, ggml-cuda's op_offload "
    "test; the context's op_offload is on by default), the scheduler instead copies the whole expert tensors of "
    "those layers (all 256 experts) to the GPU and runs them there, every pass: a B = 32 block pass and every "
    "prefill ubatch (up to 512 rows) pay that copy; ar steps, verifications of a few rows and B = 8/16 blocks do not."
)


def make_skeleton(workdir: Path) -> Path:
    model_dir = workdir / "clover-35b-config"
    skeleton = workdir / "clover-35b-bf16-skeleton.gguf"
    if not skeleton.exists():
        subprocess.run([sys.executable, "-m", "clover_ref.cli", "init", str(model_dir), "--preset", "35b-shape",
                        "--config-only"], check=True)
        subprocess.run([sys.executable, "-m", "clover_convert", str(model_dir), str(skeleton), "--outtype", "bf16",
                        "--dry-run", "--skeleton"], check=True, stdout=subprocess.DEVNULL)
    return skeleton


def plans(skeleton: Path, types: list[str] = TYPES) -> dict[str, dict]:
    from clover_quantize.cli import print_plan
    from clover_quantize.gguf_input import read_input
    from clover_quantize.run import QuantizeOptions, plan_quantization
    from clover_quantize.file_types import file_type

    model = read_input(skeleton)
    out: dict[str, dict] = {}
    for name in types:
        plan = plan_quantization(QuantizeOptions(input=skeleton, file_type=file_type(name), dry_run=True), model)
        out[name] = {"bytes": plan.dst_bytes, "gib": plan.dst_bytes / GIB, "bpw": plan.bits_per_weight,
                     "by_type": {k: {"tensors": n, "bytes": b} for k, (n, b) in plan.types_by_count().items()},
                     "src_bytes": plan.src_bytes, "tensors": len(plan.tensors),
                     "tensor_bytes": {t.name: t.dst_bytes for t in plan.tensors}}
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


def context_memory(skeleton: Path, n_ctx: int, block_sizes: list[int],
                   parallel: int = 1) -> dict[int, dict[str, float]]:
    """MiB of each context buffer llama.cpp allocates for the engine's context on the 35B, per B_max, with
    ``parallel`` slots (2 sequences each; n_ctx is the total, shared as in llama-server)."""
    from clover_native import loader, bindings

    model = bindings.LlamaModel(skeleton)
    out: dict[int, dict[str, float]] = {}
    try:
        for b in block_sizes:
            lines: list[str] = []
            with loader.log_listener(lambda _level, line: lines.append(line)):
                # the engine's settings (tools/clover/clover.cpp): n_ubatch = max(B + 1, 512), n_rs_seq = B - 1
                ctx = bindings.Context(model, n_ctx=n_ctx, n_batch=512, n_ubatch=max(b + 1, 512),
                                            n_rs_seq=b - 1, n_threads=2, n_seq_max=2 * parallel)
                ctx.close()
            sizes = {k: sum(float(m.group(1)) for ln in lines for m in [rx.search(ln)] if m)
                     for k, rx in _SIZES.items()}
            out[b] = sizes
            print(f"B_max {b:2d}: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in sizes.items()), flush=True)
    finally:
        model.close()
    return out


def offload_rows(skeleton: Path, plan: dict[str, dict], memory: dict[int, dict[str, float]]) -> dict:
    """Step 4: per N (--n-cpu-moe N, -ngl 99, Q4_K_M), bytes on each side and bytes moved per pass."""
    from gguf import GGUFReader

    from clover_cpp.offload import Offload, device_bytes

    reader = GGUFReader(skeleton, "r")
    meta = {k: int(reader.get_field(f"clover_moe.{k}").contents())  # type: ignore[union-attr]
            for k in ("block_count", "embedding_length", "expert_used_count", "expert_count")}
    n_layer, n_embd, top_k = meta["block_count"], meta["embedding_length"], meta["expert_used_count"]
    tensors = [(name, b) for name, b in plan["Q4_K_M"]["tensor_bytes"].items()]
    ctx = memory.get(OFFLOAD_B_MAX)
    ctx_bytes = int(sum(ctx.values()) * MIB) if ctx else 0
    rows = []
    for n in N_CPU_MOE:
        off = Offload(n_cpu_moe=n)
        side = device_bytes(tensors, n_layer, 99, off.overrides(n_layer))
        exps_cpu = sum(b for name, b in tensors if "_exps" in name and int(name.split(".")[1]) < n)
        act = lambda r: n * 2 * r * (n_embd + top_k) * 4  # noqa: E731 - activations out and back per CPU layer
        moved = {r: (act(r) if r < OP_OFFLOAD_MIN_BATCH else exps_cpu) for r in (1, 4, 8, 16, 32, 512)}
        gpu = side["GPU"] + ctx_bytes
        by_b = {b: side["GPU"] + int(sum(m.values()) * MIB) for b, m in memory.items()}
        rows.append({"n_cpu_moe": n, "gpu_weights": side["GPU"], "gpu_context": ctx_bytes, "gpu_total": gpu,
                     "gpu_total_by_b_max": by_b,
                     "fits_by_b_max": {b: v <= GPU_USABLE_GIB * GIB for b, v in by_b.items()},
                     "cpu_weights": side["CPU"], "experts_on_cpu": exps_cpu, "moved_per_pass": moved,
                     "fits": gpu <= GPU_USABLE_GIB * GIB})
        print(f"--n-cpu-moe {n:2d}: GPU {gpu / GIB:6.2f} GiB, host {side['CPU'] / GIB:6.2f} GiB, "
              f"1-row pass {moved[1] / 1e3:.0f} kB, 32-row pass {moved[32] / 1e9:.2f} GB", flush=True)
    return {"meta": meta, "usable_gib": GPU_USABLE_GIB, "b_max": OFFLOAD_B_MAX, "context_bytes": ctx_bytes,
            "memory_mib": memory,
            "pcie_bytes_s": PCIE_BYTES_S, "rows": rows}


def offload_report(off: dict, n_ctx: int) -> list[str]:
    meta = off["meta"]
    ctx_gib = " / ".join(f"{sum(m.values()) * MIB / GIB:.2f}" for m in off["memory_mib"].values())
    b_maxes = " / ".join(str(b) for b in off["memory_mib"])
    lines = ["## A 24 GB GPU with N expert layers in host memory (Q4_K_M, -ngl 99 --n-cpu-moe N)", "",
             f"Assumed usable on the card: {off['usable_gib']:.1f} GiB of its 24 GiB (an RTX 3090/4090 has 24,576 "
             "MiB; about 23.6 GiB are free once the CUDA context exists, less llama.cpp's default 1 GiB fit margin, "
             "which the engine's load check keeps too, and a desktop's few hundred MiB; check with nvidia-smi). "
             "Weights are placed by llama.cpp's "
             "rules (`clover_cpp.offload.device_bytes`: token_embd stays in host memory, every other tensor on the "
             r"GPU unless an override matches, here --n-cpu-moe's `blk\.<i>\.ffn_(up|down|gate|gate_up)_(ch|)exps` "
             f"for i < N). GPU context = KV + recurrent state + compute of the engine's context at {n_ctx:,d} tokens, "
             f"B_max {b_maxes} ({ctx_gib} GiB, the table above; llama.cpp puts each layer's "
             "KV and recurrent state with the layer, here all on the GPU; the compute buffer measured on the CPU "
             "stands in for the GPU's). Host: weights only (mmapped; the host's own compute buffer is small and "
             "not counted).", "",
             "| N | GPU weights GiB | GPU total GiB, B_max 8 / 16 / 32 | fits 22.0 GiB (B_max 8 / 16 / 32) | "
             "host weights GiB | moved per 1-row pass (ar step) | 8-row pass (B = 8 block) | 32-row pass "
             "(B = 32 block, prefill ubatch) | 32-row pass at 25 GB/s |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in off["rows"]:
        m = r["moved_per_pass"]
        tot = " / ".join(f"{v / GIB:.2f}" for v in r["gpu_total_by_b_max"].values())
        fits = " / ".join("yes" if v else "no" for v in r["fits_by_b_max"].values())
        lines.append(f"| {r['n_cpu_moe']} | {r['gpu_weights'] / GIB:.2f} | {tot} | {fits} | "
                     f"{r['cpu_weights'] / GIB:.2f} | {m[1] / 1e3:.0f} kB | "
                     f"{m[8] / 1e3:.0f} kB | {m[32] / 1e9:.2f} GB | {m[32] / off['pcie_bytes_s'] * 1e3:.0f} ms |")
    per_layer = (off["rows"][1]["experts_on_cpu"] / off["rows"][1]["n_cpu_moe"]) if len(off["rows"]) > 1 else 0
    first = {b: min((r["n_cpu_moe"] for r in off["rows"] if r["fits_by_b_max"][b]), default=None)
             for b in off["rows"][0]["fits_by_b_max"]}
    lines += ["", "The smallest N listed that fits: " + ", ".join(f"B_max {b}: {n}" for b, n in first.items())
              + f". Each layer's experts are {per_layer / GIB:.3f} GiB at Q4_K_M (n_embd "
              f"{meta['embedding_length']}, {meta['expert_count']} experts, top-{meta['expert_used_count']}), so "
              "each step of N frees that much GPU memory.", "",
              "**Bytes moved per pass.** " + PASS_RULE + " Passes below 32 rows cost the host's mat-muls instead "
              "(memory-bound: the 8 selected experts of each row, about 1/32 of each CPU layer's expert bytes per "
              "row, read from host RAM). `GGML_OP_OFFLOAD_MIN_BATCH` raises the threshold (e.g. 64 keeps B = 32 "
              "blocks on the host's experts); prefill then runs the CPU layers on the host too. Not counted, as every "
              "pass moves them whatever N: the token ids in and the logits of the requested rows out "
              "(n_vocab x 4 bytes, about 1 MB per row).", ""]
    return lines


def layer_split_device(il: int, n_layer: int, shares: list[float]) -> int:
    """llama.cpp's layer split with -ngl >= n_layer + 1: the device of layer il (il = n_layer is the output)."""
    total, cum = sum(shares), 0.0
    for dev, share in enumerate(shares):
        cum += share / total
        if il / (n_layer + 1) < cum:
            return dev
    return len(shares) - 1


def rpc_split(tensor_bytes: dict[str, int], memory: dict[str, dict[str, float]], n_layer: int,
              attention_layers: set[int]) -> dict:
    """Q8_0 on two equal rpc-server devices: bytes of weights and context on each, and what stays on the host."""
    shares = [1.0, 1.0]
    weights = [0, 0]
    host = 0
    layers: list[list[int]] = [[], []]
    for il in range(n_layer + 1):
        layers[layer_split_device(il, n_layer, shares)].append(il)
    for name, nbytes in tensor_bytes.items():
        if name.startswith("token_embd"):
            host += nbytes
            continue
        m = re.match(r"^blk\.(\d+)\.", name)
        il = int(m.group(1)) if m else n_layer
        weights[layer_split_device(il, n_layer, shares)] += nbytes
    sides = []
    n_attn, n_gdn = len(attention_layers), n_layer - len(attention_layers)
    for dev in range(2):
        blk = [il for il in layers[dev] if il < n_layer]
        attn = sum(1 for il in blk if il in attention_layers)
        by_b = {}
        for b, m in memory.items():
            ctx = (m["kv"] * attn / n_attn + m["rs"] * (len(blk) - attn) / n_gdn + m["compute"]) * MIB
            by_b[b] = {"context": int(ctx), "total": int(weights[dev] + ctx)}
        sides.append({"layers": f"{layers[dev][0]}-{layers[dev][-1]}" + (" + output" if n_layer in layers[dev] else ""),
                      "attention_layers": attn, "weights": weights[dev], "by_b_max": by_b})
    out_mib = max(m["output"] for m in memory.values()) if memory else 0.0
    return {"sides": sides, "host_weights": host, "host_output_buffer": int(out_mib * MIB),
            "machine_bytes": MACHINE_BYTES}


def rpc_report(r: dict, n_ctx: int) -> list[str]:
    lines = ["# Clover-35B-A3B Q8_0 on two 24 GB machines (llama.cpp RPC)", "",
             "From `bench/plan_35b.py --rpc-split`: the Q8_0 per-tensor plan (`clover-quantize --dry-run` on the "
             "35b-shape skeleton) placed by llama.cpp's layer split with -ngl 99 over two rpc-server devices of equal "
             "free memory (41 layers: 40 blocks + the output layer); each side's context is its layers' share of the "
             f"KV cache and recurrent state at {n_ctx:,d} tokens (bench/results/plan_35b.md) plus a whole compute "
             "buffer (measured for the full graph on one device: an upper bound for each side's).", "",
             "| side | layers | attention layers | weights GiB | context GiB, B_max 8 / 16 / 32 | "
             "total GiB, B_max 8 / 16 / 32 | fits 22.35 GiB (B_max 8 / 16 / 32) |", "|---|---|---:|---:|---|---|---|"]
    for i, side in enumerate(r["sides"]):
        ctx = " / ".join(f"{v['context'] / GIB:.2f}" for v in side["by_b_max"].values())
        tot = " / ".join(f"{v['total'] / GIB:.2f}" for v in side["by_b_max"].values())
        fits = " / ".join("yes" if v["total"] < r["machine_bytes"] * 0.9 else
                          ("tight" if v["total"] < r["machine_bytes"] else "no") for v in side["by_b_max"].values())
        lines.append(f"| rpc-server {i} | {side['layers']} | {side['attention_layers']} | {side['weights'] / GIB:.2f} "
                     f"| {ctx} | {tot} | {fits} |")
    lines += ["", f"The client (clover-cpp) keeps the input embedding ({r['host_weights'] / GIB:.2f} GiB, mmapped) and "
              f"the logits buffer ({r['host_output_buffer'] / MIB:.0f} MiB) in its own memory: on the machine that "
              "also runs rpc-server 0, add those and the Python process (about 1 GiB). 24 GB = 22.35 GiB before the "
              "OS; 'tight' means above 90 % of it. An rpc-server on a CPU holds its weights in RAM (not mmapped): "
              "they cross the network once at load (rpc-server -c caches them on the server's disk for the next "
              "load).", ""]
    return lines


def attention_layer_ids(skeleton: Path) -> set[int]:
    from gguf import GGUFReader

    reader = GGUFReader(skeleton, "r")
    return {int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk.") and ".attn_q." in t.name}


def write_report(plan: dict[str, dict], memory: dict[int, dict[str, float]], n_ctx: int, offload: dict,
                 parallel: int = 1, report: str = "plan_35b") -> None:
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
        slots = (f"{parallel} slots (`-np {parallel}`: {2 * parallel} sequences, each slot {n_ctx // parallel:,d} "
                 "positions of the shared KV cache)") if parallel > 1 else "one slot (2 sequences)"
        lines += [f"## Memory at a {n_ctx:,d}-token context (CPU, engine settings, {slots})", "",
                  f"KV cache (10 attention layers, f16), recurrent state (30 GDN layers, {2 * parallel} sequences, "
                  "n_rs_seq = B_max - 1 rollback snapshots each) and compute buffer, as llama.cpp allocates them; "
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
    if offload:
        lines += offload_report(offload, n_ctx)
    (RESULTS / f"{report}.md").write_text("\n".join(lines))
    plans_out = {k: {kk: vv for kk, vv in v.items() if kk != "tensor_bytes"} for k, v in plan.items()}
    (RESULTS / f"{report}.json").write_text(json.dumps({"plans": plans_out, "memory_mib": memory, "n_ctx": n_ctx,
                                                      "parallel": parallel, "offload_24gb": offload}, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / "plan-35b")
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--parallel", "-np", type=int, default=1, help="slots (2 sequences each; --ctx is shared "
                        "among them, as llama-server divides -c); results go to plan_35b_np<N>.md for N > 1")
    parser.add_argument("--skip-memory", action="store_true", help="only the plans (the memory step maps the "
                        "64 GiB skeleton and takes about a minute)")
    parser.add_argument("--rpc-split", action="store_true", help="only step 5 (Q8_0 on two machines over RPC), with "
                        "the context memory of bench/results/plan_35b.json")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    skeleton = make_skeleton(args.workdir)
    if args.rpc_split:
        saved = json.loads((RESULTS / "plan_35b.json").read_text())
        memory = saved["memory_mib"]
        q8 = plans(skeleton, ["Q8_0"])["Q8_0"]
        n_layer = int(saved["offload_24gb"]["meta"]["block_count"])
        r = rpc_split(q8["tensor_bytes"], memory, n_layer, attention_layer_ids(skeleton))
        (RESULTS / "plan_35b_rpc.md").write_text("\n".join(rpc_report(r, saved["n_ctx"])))
        (RESULTS / "plan_35b_rpc.json").write_text(json.dumps(r, indent=1))
        print("\n".join(rpc_report(r, saved["n_ctx"])))
        return 0
    plan = plans(skeleton)
    if args.parallel < 1:
        parser.error("--parallel must be at least 1")
    memory = {} if args.skip_memory else context_memory(skeleton, args.ctx, [8, 16, 32], args.parallel)
    offload = offload_rows(skeleton, plan, memory) if memory else {}
    name = "plan_35b" if args.parallel == 1 else f"plan_35b_np{args.parallel}"
    write_report(plan, memory, args.ctx, offload, args.parallel, name)
    print(f"wrote {RESULTS / (name + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
