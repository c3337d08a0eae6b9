"""Real agent CLIs against `clover-cpp serve` on the demo model (docs/serve.md, "Agents"): Claude Code 2.1.328 over
the Anthropic Messages API and Codex 0.169.0 over the Responses API, pinned in the Makefile (`make agents`, part of
`make setup`, installs them from npm into build/agents). Each sends its real first request (about 18,000 and 9,700
tokens of system prompt and tool definitions) and ends its one turn: exit status 0, no error in its result.

The setting is the issue's: the demo's declared 32K context, thinking off, and a capped output. The demo model was
trained on conversations of under 900 tokens; these agents' first prompts are 10-20 times longer, where nothing
makes it end its turn within the cap, and both agents treat an answer cut by the cap as an error (Claude Code:
"response exceeded the ... output token maximum"). So the server biases the end-of-turn token with llama-server's
`--logit-bias` (+20) and fixes the seed: answers end within the cap, the same on every run of the same prompt.
tests/native/test_agent_tool_call.py has an agent whose prompt the model was trained for, with nothing biased.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from clover_dev import REPO_ROOT
from tests.support.native import skip_or_fail
from tests.support.serve import clover_serve

pytestmark = pytest.mark.native

AGENTS = REPO_ROOT / "build" / "agents" / "node_modules" / ".bin"
CONTEXT = 32768
END_OF_TURN = "<|im_end|>"


def _agent(name: str) -> Path:
    path = AGENTS / name
    if not path.exists():
        skip_or_fail(f"{path} is missing (make agents installs the agent CLIs)")
    return path


def _end_of_turn_id(url: str) -> int:
    import urllib.request

    req = urllib.request.Request(url + "/tokenize", json.dumps({"content": END_OF_TURN, "parse_special": True})
                                 .encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        (token,) = json.loads(r.read())["tokens"]
    return int(token)


def _server_args(mode: str, eot: int) -> tuple[str, ...]:
    return ("-c", str(CONTEXT), "-np", "1", "-t", "2", "--no-warmup", "--think", "off", "-n", "64", "-s", "7",
            "--mode", mode, "--alias", "demo", "--logit-bias", f"{eot}+20")


@pytest.fixture(scope="module")
def eot(demo_gguf: Path) -> int:
    with clover_serve(demo_gguf, "-c", "512", "-np", "1", "--no-warmup") as (url, _, _):
        return _end_of_turn_id(url)


def _prompts(log: Path) -> list[int]:
    """The prompt sizes of the requests the server answered."""
    return [int(n) for n in re.findall(r"prompt eval time = .*?/\s+(\d+) tokens", log.read_text())]


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=os.environ | env, cwd=cwd, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("mode", ["ar", "auto"])
def test_claude_code_one_turn(demo_gguf: Path, tmp_path: Path, eot: int, mode: str) -> None:
    claude = _agent("claude")
    with clover_serve(demo_gguf, *_server_args(mode, eot)) as (url, _, log):
        done = _run([str(claude), "-p", "Say hello.", "--model", "demo", "--max-turns", "1", "--output-format", "json"],
                    {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "none", "HOME": str(tmp_path),
                     "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                     "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"}, tmp_path)
        prompts = _prompts(log)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    result = json.loads(done.stdout)
    assert result["is_error"] is False and result["num_turns"] == 1 and result["subtype"] == "success", result
    assert max(prompts) > 10_000, prompts  # its whole system prompt and tools reached the model


@pytest.mark.parametrize("mode", ["ar", "auto"])
def test_codex_exec_one_turn(demo_gguf: Path, tmp_path: Path, eot: int, mode: str) -> None:
    codex = _agent("codex")
    home = tmp_path / "codex"
    home.mkdir()
    with clover_serve(demo_gguf, *_server_args(mode, eot)) as (url, _, log):
        (home / "config.toml").write_text(f'model = "demo"\nmodel_provider = "clover"\n\n'
                                          f'[model_providers.clover]\nname = "clover-cpp serve"\n'
                                          f'base_url = "{url}/v1"\nwire_api = "responses"\n'
                                          f'env_key = "CLOVER_API_KEY"\n')
        done = _run([str(codex), "exec", "--skip-git-repo-check", "Say hello."],
                    {"CODEX_HOME": str(home), "HOME": str(tmp_path), "CLOVER_API_KEY": "none"}, tmp_path)
        prompts = _prompts(log)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert "ERROR" not in done.stderr and "tokens used" in done.stderr, done.stderr[-2000:]
    assert len(prompts) == 1 and prompts[0] > 5_000, prompts
