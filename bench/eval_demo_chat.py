"""The demo model in chat (the model card's chat figures; not a test): does it end its turn, and does it call tools?

    .venv/bin/python -m bench.eval_demo_chat MODEL_DIR [--cases 50] [--temperature 0.7] [--max-tokens 128]

On held-out conversations of clover_ref/chat_data.py (functions asked about, paths, commands and values that the
training stage never saw), rendered and parsed by llama.cpp's common/chat as llama-server does, thinking off,
sampled at ``--temperature`` with a fixed seed per case, no grammar:
- **questions:** the share of code questions whose answer ends with the end-of-turn token within ``--max-tokens``;
- **tool calls:** given the tool list and a request that names a tool, the share of answers that common/chat parses
  as one call to a listed tool with every required argument (``well_formed``), and of those, the share whose
  arguments are the request's values (``exact``).
Each mode in ``--modes`` runs the same cases (greedy ``ar`` is also reported for the questions, with the top-2 margin
of the first token of each tool call).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path
from typing import Any

from bench.eval_demo_model import f32_gguf
from clover_ref.chat_data import Example, examples

EVAL_SEED = 1


def _required(tools: list[dict[str, Any]]) -> dict[str, list[str]]:
    return {t["function"]["name"]: t["function"]["parameters"]["required"] for t in tools}


def judge_call(example: Example, calls: list[dict[str, Any]]) -> tuple[bool, bool]:
    """(well formed: one call to a listed tool with all its required arguments, exact: the requested call)."""
    if len(calls) != 1:
        return False, False
    fn = calls[0].get("function", calls[0])
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError:
        return False, False
    required = _required(example.tools or [])
    name = fn.get("name")
    well_formed = name in required and isinstance(args, dict) and all(k in args for k in required[name])
    want = example.expected_call or {}
    exact = well_formed and name == want.get("name") and \
        {k: str(v) for k, v in args.items()} == {k: str(v) for k, v in want.get("arguments", {}).items()}
    return well_formed, exact


def evaluate(gguf: Path, cases: int, temperature: float, max_tokens: int, modes: list[str]) -> dict[str, Any]:
    import clover_cpp
    from clover_cpp.chat_format import ChatTemplates, parse_answer

    questions = list(examples("held-out", cases, EVAL_SEED, kinds=("question",), thinking_share=0.0))
    tool_cases = list(examples("held-out", cases, EVAL_SEED, kinds=("tool",), thinking_share=0.0))
    out: dict[str, Any] = {"cases": cases, "temperature": temperature, "max_tokens": max_tokens, "seed": EVAL_SEED}
    with clover_cpp.Model(str(gguf), n_ctx=2048, n_threads=2, max_block_size=32) as model:
        templates = ChatTemplates(model.llama_model, None, f"{gguf}: tokenizer.chat_template")

        def answer(example: Example, seed: int, mode: str, temp: float) -> tuple[str, Any]:
            rendered = templates.render(example.prompt_messages(), tools=example.tools, enable_thinking=False)
            model.reset()
            result = model.run(rendered.prompt, mode=mode, max_tokens=max_tokens, temperature=temp, seed=seed)
            text = model.detokenize(result.tokens, special=False)
            return text, (rendered, result)

        for mode in modes:
            ended = 0
            samples = []
            for i, ex in enumerate(questions):
                text, (_, result) = answer(ex, i, mode, temperature)
                ended += int(result.stats.stop_reason == "eos")
                if i < 3:
                    samples.append({"question": ex.prompt_messages()[-1]["content"], "answer": text})
            well = exact = 0
            tool_samples = []
            for i, ex in enumerate(tool_cases):
                text, (rendered, _) = answer(ex, i, mode, temperature)
                with contextlib.suppress(Exception):
                    calls = parse_answer(rendered, text, parse_tools=True).tool_calls
                    w, e = judge_call(ex, calls)
                    well, exact = well + w, exact + e
                if i < 3:
                    tool_samples.append({"request": ex.prompt_messages()[-1]["content"], "answer": text})
            out[mode] = {"ended_turn": ended / cases, "tool_call_well_formed": well / cases,
                         "tool_call_exact": exact / cases, "question_samples": samples, "tool_samples": tool_samples}
        out["greedy_tool_margins"] = tool_margins(model, templates, tool_cases, max_tokens)
        templates.close()
    return out


def tool_margins(model: Any, templates: Any, cases: list[Example], max_tokens: int) -> dict[str, float]:
    """Greedy ar: the top-2 logprob margin at the token that opens each case's tool call (median and minimum over the
    cases whose greedy answer opens one): how far a pass is from a coin toss."""
    margins = []
    for ex in cases:
        rendered = templates.render(ex.prompt_messages(), tools=ex.tools, enable_thinking=False)
        model.reset()
        result = model.run(rendered.prompt, mode="ar", max_tokens=max_tokens, logprobs=2)
        for token, lp in zip(result.tokens, result.logprobs or []):
            if model.detokenize([token]) == "<tool_call>":
                top = sorted((logprob for _, logprob in lp.top), reverse=True)
                margins.append(top[0] - top[1] if len(top) > 1 else math.inf)
                break
    margins.sort()
    return {"cases_opening_a_call": len(margins), "median": margins[len(margins) // 2] if margins else math.nan,
            "min": margins[0] if margins else math.nan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--modes", default="ar", help="comma-separated modes (ar, auto, spec, diffusion)")
    args = parser.parse_args()
    with f32_gguf(args.model_dir) as gguf:
        figures = evaluate(gguf, args.cases, args.temperature, args.max_tokens, args.modes.split(","))
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
