#!/usr/bin/env python3
"""Time to first token of a growing chat over `clover-cpp serve`, with and without prefix reuse.

    .venv/bin/python -m bench.bench_serve [--preset mid] [--quant Q8_0] [--turns 10] [--workdir build/bench-serve]
        [--skip-thinking]

The server is `clover-cpp serve` (llama-server: its prompt cache, with the recurrent state's context checkpoints).

One server (the `mid` preset quantized to Q8_0: Qwen3.5-35B-A3B's per-layer dims, 4 layers), driven by the
official openai client, greedy `ar`. A conversation of --turns turns, each user turn about 300 tokens and
each answer 128 tokens (ignore_eos), is run in one server with prefix reuse (the default) and with
`cache_prompt: false` (a fresh prefill, as before reuse), side by side: each turn is asked with reuse, then
again fresh. Time to first token is measured at the client, from the request to the first streamed token.
Then the same with thinking on, and four requests sharing a 2K-token system prompt.

Results: bench/results/bench_serve.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
WORDS = ("the of and to in is for on with as by at from that this are be or an it not value data model "
         "function return list index file error state cache token layer block expert router attention "
         "memory thread server client request answer prompt history checkpoint prefix batch").split()


def log(msg: str) -> None:
    print(f"[bench_serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_model(work: Path, preset: str, quant: str) -> Path:
    from clover_ref.factory import init_checkpoint
    from clover_dev.convert import clover_convert, quantize

    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{preset}-{quant}.gguf"
    if path.exists():
        return path
    ckpt = work / f"{preset}-ckpt"
    if not (ckpt / "config.json").exists():
        init_checkpoint(ckpt, preset, seed=0)
    f16 = clover_convert(ckpt, work / f"{preset}-f16.gguf", "f16")
    return f16 if quant == "f16" else quantize(f16, path, quant)


def server_argv(gguf: Path, n_ctx: int, port: int) -> list[str]:
    """`clover-cpp serve` (llama-server): one slot holding the whole context, as the earlier server's."""
    from clover_dev.process import cli_command

    return cli_command("serve", "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(n_ctx),
                       "-np", "1", "--no-warmup")


def words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n))


def ask(client: Any, model: str, messages: list[dict[str, Any]], max_tokens: int, cache: bool,
        thinking: bool) -> dict[str, Any]:
    """One streamed request: time to the first token, the answer text, and usage."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"mode": "ar", "ignore_eos": True, "cache_prompt": cache,
                    "chat_template_kwargs": {"enable_thinking": thinking}})
    ttft = None
    text: list[str] = []
    usage = None
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            piece = (delta.content or "") + (delta.model_extra.get("reasoning_content") or "")
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
    return {"ttft_s": ttft, "wall_s": time.perf_counter() - t0, "prompt_tokens": usage.prompt_tokens if usage else 0,
            "cached_tokens": cached, "text": "".join(text) or "ok"}


def conversation(client: Any, model: str, turns: int, user_words: int, answer: int,
                 thinking: bool) -> dict[str, list[dict[str, Any]]]:
    """Each turn twice, side by side: first with reuse (the history holds the previous turn), then the same
    request with a fresh prefill (which leaves the history the next turn reuses)."""
    rng = np.random.default_rng(7)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    out: dict[str, list[dict[str, Any]]] = {"reuse": [], "fresh": []}
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": words(rng, user_words)})
        reuse = ask(client, model, messages, answer, True, thinking)
        fresh = ask(client, model, messages, answer, False, thinking)
        messages.append({"role": "assistant", "content": reuse.pop("text")})
        fresh.pop("text")
        out["reuse"].append({"turn": turn, **reuse})
        out["fresh"].append({"turn": turn, **fresh})
        log(f"thinking={thinking} turn {turn}: prompt {reuse['prompt_tokens']} tokens, {reuse['cached_tokens']} "
            f"reused; ttft {reuse['ttft_s']:.2f} s with reuse, {fresh['ttft_s']:.2f} s fresh")
    return out


def shared_system(client: Any, model: str, n: int, system_words: int) -> dict[str, list[dict[str, Any]]]:
    """n requests with one system prompt and different user messages: with reuse, then each again fresh."""
    rng = np.random.default_rng(11)
    system = words(rng, system_words)
    users = [words(rng, 60) for _ in range(n)]
    out: dict[str, list[dict[str, Any]]] = {}
    for cache in (True, False):
        out["reuse" if cache else "fresh"] = rows = []
        for i, user in enumerate(users):
            r = ask(client, model, [{"role": "system", "content": system}, {"role": "user", "content": user}],
                    8, cache, False)
            r.pop("text")
            rows.append({"request": i + 1, **r})
            log(f"shared system cache={cache} request {i + 1}: ttft {r['ttft_s']:.2f} s, {r['cached_tokens']} reused")
    return out


def render(res: dict[str, Any]) -> str:
    lines = [f"# Time to first token with prefix reuse (`clover-cpp {res.get('server', 'serve')}`)", "",
             f"{res['machine']}; `{res['command']}`. Model: {res['model']}, greedy `ar`, one server, "
             f"the openai client streaming; TTFT measured at the client. Each turn: a user message of about "
             f"{res['user_tokens']} tokens, an answer of {res['answer_tokens']} tokens.", ""]
    for key, title in (("think_off", "thinking off"), ("think_on", "thinking on")):
        if key not in res:
            continue
        with_r, without = res[key]["reuse"], res[key]["fresh"]
        lines += [f"## Growing chat, {title}", "",
                  "| turn | prompt tokens | reused | TTFT with reuse (s) | TTFT fresh prefill (s) | ratio |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for a, b in zip(with_r, without):
            if a["turn"] in (1, 5, 10) or a["turn"] == len(with_r):
                lines.append(f"| {a['turn']} | {a['prompt_tokens']} | {a['cached_tokens']} | {a['ttft_s']:.2f} | "
                             f"{b['ttft_s']:.2f} | {b['ttft_s'] / a['ttft_s']:.1f}x |")
        last = with_r[-1]["ttft_s"] / with_r[0]["ttft_s"]
        noise = without[0]["ttft_s"] / with_r[0]["ttft_s"]
        lines += ["", f"Turn {len(with_r)} against turn 1 with reuse: **{last:.2f}x** (goal: at most 1.5x); "
                  f"fresh prefill: {without[-1]['ttft_s'] / without[0]['ttft_s']:.2f}x. Turn 1 does the same work "
                  f"both ways, so its ratio ({noise:.2f}x) shows how noisy this run's machine was.", ""]
    if "shared" not in res:
        return "\n".join(lines) + "\n"
    lines += ["## Requests sharing a system prompt", "",
              "| request | prompt tokens | reused | TTFT with reuse (s) | TTFT fresh prefill (s) |",
              "|---:|---:|---:|---:|---:|"]
    for a, b in zip(res["shared"]["reuse"], res["shared"]["fresh"]):
        lines.append(f"| {a['request']} | {a['prompt_tokens']} | {a['cached_tokens']} | {a['ttft_s']:.2f} | "
                     f"{b['ttft_s']:.2f} |")
    lines += ["", f"Checkpoints: {res['cache']}", ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    from openai import OpenAI

    from clover_dev.process import free_port, serving

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mid")
    ap.add_argument("--quant", default="Q8_0")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--user-words", type=int, default=220, help="about 300 tokens with the test tokenizer")
    ap.add_argument("--answer", type=int, default=128)
    ap.add_argument("--system-words", type=int, default=1500, help="about 2K tokens")
    ap.add_argument("--workdir", type=Path, default=REPO / "build" / "bench-serve")
    ap.add_argument("--name", default="bench_serve")
    ap.add_argument("--skip-thinking", action="store_true", help="no second conversation with thinking on")
    args = ap.parse_args()
    gguf = make_model(args.workdir, args.preset, args.quant)
    port = free_port()
    with serving(server_argv(gguf, 8192, port), port, log_path=args.workdir / "server.log", ready_s=300) as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        res: dict[str, Any] = {"model": f"{args.preset} {args.quant}", "answer_tokens": args.answer,
                               "server": "serve",
                               "command": "bench/bench_serve.py " + " ".join(sys.argv[1:])}
        res["think_off"] = conversation(client, model, args.turns, args.user_words, args.answer, False)
        res["user_tokens"] = round(np.mean(np.diff([0] + [t["prompt_tokens"] for t in res["think_off"]["fresh"]]))
                                   - args.answer)
        save(res, args.name)  # each phase is written as it ends: a long run cut short keeps what it measured
        res["shared"] = shared_system(client, model, 4, args.system_words)
        res["cache"] = "llama-server's prompt cache"
        save(res, args.name)
        if not args.skip_thinking:
            res["think_on"] = conversation(client, model, args.turns, args.user_words, args.answer, True)
    save(res, args.name)
    log(f"wrote bench/results/{args.name}.md")
    return 0


def save(res: dict[str, Any], name: str) -> None:
    from clover_native import loader

    res["machine"] = loader.machine_summary()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1))
    (RESULTS / f"{name}.md").write_text(render(res))


if __name__ == "__main__":
    sys.exit(main())
