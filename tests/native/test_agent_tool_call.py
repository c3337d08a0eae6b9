"""An agent CLI runs a tool through `clover-cpp serve` on the demo model, end to end (docs/serve.md, "Agents").

The agent is Simon Willison's `llm` (PyPI, pinned in pyproject's [test] extra), a real client of the OpenAI Chat
Completions API: it offers the model a Python function as a tool, executes the call the model makes, sends the
result back, and prints the model's answer. The demo model was trained to call tools in its template's format (the
Qwen3.5 family's XML calls; docs/training.md, "Second stage: chat"), so nothing here biases or constrains it:
greedy, `tool_choice` auto, no grammar until the call opens (llama-server's lazy grammar).

A pass must not be luck: the test also asks the server for the top-2 log-probabilities at the token that opens the
call, and requires a margin (the greedy choice is not a near tie).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.serve import clover_serve, post

pytestmark = pytest.mark.native

LLM = Path(sys.executable).parent / "llm"
REQUEST = "Use read_file to show me src/app.py."
TOOL = '''
import json, os


def read_file(path: str) -> str:
    """Read a text file and return its contents."""
    with open(os.environ["CLOVER_TOOL_LOG"], "a") as log:
        log.write(json.dumps({"path": path}) + "\\n")
    return "def load_config():\\n    return 42"
'''
# The margin the greedy tool call must have over the runner-up at its first token (nats): a coin toss is 0.
MIN_MARGIN = 1.0


def _llm(url: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    home = tmp_path / "llm-home"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: clover-demo\n  model_name: demo\n  api_base: {url}/v1\n  supports_tools: true\n")
    tools = tmp_path / "tools.py"
    tools.write_text(TOOL)
    env = {"LLM_USER_PATH": str(home), "CLOVER_TOOL_LOG": str(tmp_path / "calls.jsonl"), "HOME": str(tmp_path)}
    return subprocess.run([str(LLM), "prompt", "-m", "clover-demo", "--functions", str(tools), "--no-log",
                           "-o", "temperature", "0", "--chain-limit", "3", REQUEST],
                          env=os.environ | env, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)


def _call_margin(url: str) -> float:
    """Greedy: the top-2 logprob margin at the first token of the answer, which opens the call."""
    tool = {"type": "function", "function": {"name": "read_file", "description": "Read a text file and return its "
            "contents.", "parameters": {"properties": {"path": {"type": "string"}}, "required": ["path"],
                                        "type": "object"}}}
    body = {"model": "demo", "messages": [{"role": "user", "content": REQUEST}], "tools": [tool], "temperature": 0,
            "max_tokens": 1, "logprobs": True, "top_logprobs": 2}
    status, answer = post(url + "/v1/chat/completions", body)
    assert status == 200, answer
    first = answer["choices"][0]["logprobs"]["content"][0]
    assert first["token"] == "<tool_call>", first
    top = sorted((t["logprob"] for t in first["top_logprobs"]), reverse=True)
    return top[0] - top[1]


@pytest.mark.parametrize("mode", ["ar", "auto"])
def test_llm_cli_calls_a_tool_and_answers(demo_gguf: Path, tmp_path: Path, mode: str,
                                          record_property: pytest.RecordProperty) -> None:
    if not LLM.exists():
        pytest.fail(f"{LLM} is missing: make setup installs llm (pyproject's [test] extra)")
    with clover_serve(demo_gguf, "-c", "4096", "-np", "1", "-t", "2", "--no-warmup", "--think", "off",
                      "-n", "128", "--mode", mode, "--alias", "demo") as (url, _, _):
        margin = _call_margin(url)
        done = _llm(url, tmp_path)
    record_property("tool_call_top2_margin", round(margin, 3))
    print(f"{mode}: top-2 margin at <tool_call>: {margin:.3f} nats")
    assert margin >= MIN_MARGIN, margin
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    log = tmp_path / "calls.jsonl"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    # The agent executed the call: a path, as the tool's schema asks. The demo model picks the tool and writes a
    # well-formed call, but does not copy the request's argument (models/clover-demo/README.md, "Chat").
    assert 1 <= len(calls) <= 3 and all(isinstance(c["path"], str) and c["path"] for c in calls), calls
    record_property("tool_call_arguments", calls)
    answer = done.stdout.strip()
    assert answer and "<tool_call>" not in answer and "<function=" not in answer, answer  # it ended with an answer
