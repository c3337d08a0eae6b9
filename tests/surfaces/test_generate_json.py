"""One `--json` schema for `clover-ref generate`, `clover-cpp generate` and `llama-clover` (ecosystem issue).

The three commands run on the tiny test model; each output is validated against
docs/generate-output.schema.json, the derived stats are checked against their definitions
(docs/engine-python.md), and in greedy ar the three agree on the prompt and the generated tokens. Also here:
llama.cpp's flag names (clover-cpp aliases, llama-clover's -b = batch size) and llama-clover's number checks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clover_dev import REPO_ROOT
from clover_dev.convert import clover_convert
from tests.support.schema import load_schema, validate
from tests.support.tmp import MkTemp

SCHEMA = REPO_ROOT / "docs" / "generate-output.schema.json"
PROMPT = "def fibonacci(n):"
N = 8


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(tiny_checkpoint, module_tmp("json") / "tiny-f32.gguf", "f32")


def _llama_clover() -> Path:
    from clover_native import loader

    tool = loader.tool_path("llama-clover")
    assert tool.exists(), f"{tool} missing (make native)"
    return tool


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO_ROOT), timeout=300)


def _json(cmd: list[str]) -> dict:
    done = _run(cmd)
    assert done.returncode == 0, (cmd, done.stderr[-3000:])
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    return json.loads(lines[0])


def run_three(checkpoint: Path, gguf: Path, mode: str, *opts: str) -> dict[str, dict]:
    common = ["-p", PROMPT, "--mode", mode, "-n", str(N), "--json", *opts]
    return {
        "clover-ref": _json([sys.executable, "-m", "clover_ref.cli", "generate", str(checkpoint), *common]),
        "clover-cpp": _json([sys.executable, "-m", "clover_cpp.cli", "generate", "-m", str(gguf), *common]),
        "llama-clover": _json([str(_llama_clover()), "-m", str(gguf), *common]),
    }


def check_definitions(name: str, out: dict) -> None:
    """The stats that the schema defines from others (docs/engine-python.md, "The --json output")."""
    s = out["stats"]
    assert s["prompt_tokens"] == len(out["prompt_ids"]), name
    assert s["generated_tokens"] == len(out["tokens"]), name
    passes = s["block_passes"] + s["causal_passes"]
    assert s["tokens_per_pass"] == pytest.approx(s["generated_tokens"] / passes if passes else 0.0), name
    for rate, count, ms in (("prefill_tok_per_s", "prompt_tokens", "prefill_ms"),
                            ("decode_tok_per_s", "generated_tokens", "decode_ms")):
        want = s[count] / (s[ms] / 1e3) if s[ms] > 0 else 0.0
        assert s[rate] == pytest.approx(want, rel=1e-6), (name, rate, s)
    for hist in ("steps_per_block", "accepted_lengths"):
        values = [int(k) for k in s[hist]]
        assert values == sorted(values), (name, hist, s[hist])
    if s["mode"] == "ar":
        assert s["block_passes"] == 0 and s["steps_per_block"] == {} and s["accepted_lengths"] == {}, name
    if s["mode"] == "diffusion":  # one commit pass per block
        assert sum(s["steps_per_block"].values()) == s["causal_passes"], name
        assert all(1 <= int(k) <= s["block_size"] for k in s["steps_per_block"]), name
    if s["mode"] == "spec":  # one verification per round
        assert sum(s["accepted_lengths"].values()) == s["causal_passes"], name


@pytest.mark.parametrize("mode", ["ar", "diffusion", "spec"])
@pytest.mark.native
def test_three_clis_share_the_schema(tiny_checkpoint: Path, tiny_gguf: Path, mode: str) -> None:
    schema = load_schema(SCHEMA)
    outs = run_three(tiny_checkpoint, tiny_gguf, mode, "--block-size", "8")
    for name, out in outs.items():
        errors = validate(out, schema)
        assert not errors, (name, errors)
        assert out["stats"]["mode"] == mode and out["stats"]["block_size"] == 8, name
        check_definitions(name, out)
    assert len({tuple(o["prompt_ids"]) for o in outs.values()}) == 1, {k: o["prompt_ids"] for k, o in outs.items()}
    if mode == "ar":  # greedy ar: the same tokens from all three
        tokens = {k: o["tokens"] for k, o in outs.items()}
        assert len({tuple(t) for t in tokens.values()}) == 1, tokens
        assert len(tokens["clover-ref"]) == N
    # the thresholds are the same float32 value
    assert len({round(o["stats"]["threshold"], 6) for o in outs.values()}) == 1


def test_schema_matches_the_python_writer() -> None:
    """generate_output's required keys are the schema's, and the validator rejects what it should."""
    from clover_common.generate_output import STATS_KEYS, TOP_KEYS, generate_output

    schema = load_schema(SCHEMA)
    assert tuple(schema["required"]) == TOP_KEYS
    assert tuple(schema["properties"]["stats"]["required"]) == STATS_KEYS
    good = generate_output(text="x", prompt_ids=[1, 2], tokens=[3], mode="spec", block_size=8, threshold=0.9,
                           prompt_tokens=2, block_passes=1, causal_passes=1, prefill_ms=1.0, decode_ms=2.0,
                           steps_per_block={}, accepted_lengths={"1": 1}, stop_reason="length")
    assert validate(good, schema) == []
    assert good["stats"]["prefill_tok_per_s"] == 2000.0 and good["stats"]["decode_tok_per_s"] == 500.0
    bad = json.loads(json.dumps(good))
    bad["stats"]["steps_per_block"] = [0, 1]  # a list is not the histogram form
    del bad["stats"]["prefill_tok_per_s"]
    bad["tokens"] = ["3"]
    errors = validate(bad, schema)
    assert len(errors) == 3, errors


# --------------------------------------------------------------------------------- llama.cpp's flag names
@pytest.mark.native
def test_clover_cpp_takes_llama_cpp_names(tiny_gguf: Path) -> None:
    """--temp, -s/--seed, -n/--n-predict, --top-k, --top-p, -c, -t, -ngl are the same options as the long
    names (same dest), in generate and chat (serve takes llama-server's own: tests/native/test_serve_launch.py)."""
    from clover_cpp.cli import build_parser

    llama_names = ["--temp", "0.5", "-s", "7", "--n-predict", "9", "--top-k", "40", "--top-p", "0.9",
                   "-c", "512", "-t", "1", "-ngl", "0"]
    want = {"temperature": 0.5, "seed": 7, "max_tokens": 9, "top_k": 40, "top_p": 0.9, "ctx_size": 512,
            "threads": 1, "n_gpu_layers": 0}
    parser = build_parser()
    for command in ("generate", "chat"):
        extra = ["-p", "x"] if command == "generate" else []
        args = parser.parse_args([command, "-m", "M.gguf", *extra, *llama_names])
        assert {k: getattr(args, k) for k in want} == want, command
        long = parser.parse_args([command, "-m", "M.gguf", *extra, "--temperature", "0.5", "--seed", "7",
                                  "--max-tokens", "9"])
        assert (long.temperature, long.seed, long.max_tokens) == (0.5, 7, 9), command
    for command in ("generate", "chat"):  # no option is defined twice
        sub = parser._subparsers._group_actions[0].choices[command]
        strings = [s for a in sub._actions for s in a.option_strings]
        assert len(strings) == len(set(strings)), command
    # and they work end to end
    a = _json([sys.executable, "-m", "clover_cpp.cli", "generate", "-m", str(tiny_gguf), "-p", PROMPT, "--mode",
               "ar", "--n-predict", "5", "--temp", "0", "-s", "3", "-c", "256", "-t", "1", "--json"])
    b = _json([sys.executable, "-m", "clover_cpp.cli", "generate", "-m", str(tiny_gguf), "-p", PROMPT, "--mode",
               "ar", "-n", "5", "--json"])
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 5


@pytest.mark.parametrize("args", [["chat", "-s", "-2"], ["chat", "--top-p", "0"], ["chat", "-n", "0"],
                                  ["generate", "-p", "x", "-s", "4294967296"]])
@pytest.mark.native
def test_clover_cpp_checks_the_new_options(tiny_gguf: Path, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "clover_cpp.cli", args[0], "-m", str(tiny_gguf), *args[1:]]
    done = _run(cmd)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clover-cpp: error:"), done.stderr


@pytest.mark.native
def test_llama_clover_b_is_the_batch_size(tiny_gguf: Path) -> None:
    """-b/--batch-size is llama.cpp's n_batch (prefill chunk): it does not change the output; the block size is
    --block-size only."""
    tool = str(_llama_clover())
    base = [tool, "-m", str(tiny_gguf), "-p", PROMPT * 3, "--mode", "diffusion", "--block-size", "4", "-n", "8",
            "--json"]
    plain = _json(base)
    for flag in ("-b", "--batch-size"):
        chunked = _json(base + [flag, "2"])
        assert chunked["tokens"] == plain["tokens"]
        assert chunked["stats"]["block_size"] == 4
    assert _json(base[:-1] + ["-s", "5", "--n-predict", "3", "--json"])["stats"]["generated_tokens"] == 3


@pytest.mark.parametrize("args", [
    ["-b", "0"], ["-b", "8x"], ["--batch-size", ""], ["--block-size", "0"], ["--block-size", "4.5"],
    ["--threshold", "1.5"], ["--threshold", "nan"], ["-n", "abc"], ["-n", "-3"], ["--top-k", "-1"],
    ["--top-p", "0"], ["--temp", "-1"], ["-s", "-1"], ["--seed", "99999999999"], ["-c", "1e3"], ["-t", "x"],
    ["-ngl", "-2"], ["-ncmoe", "1x"], ["-mg", "-1"], ["-fitt", "--"], ["--draft-steps", "2.0"],
    ["-n", "99999999999999999999"],
])
@pytest.mark.native
def test_llama_clover_rejects_bad_numbers(tiny_gguf: Path, args: list[str]) -> None:
    done = _run([str(_llama_clover()), "-m", str(tiny_gguf), "-p", "x", *args])
    assert done.returncode == 2, (args, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and args[0].lstrip("-") in lines[0], done.stderr
