"""README's "Run the released Clover-35B-A3B" runs as written, with the demo model in place of the 35B.

The block after the walkthrough marker is read from README.md and run line by line in a scratch folder:

- `make setup` is what the suite runs after, so it is skipped;
- `hf download` (no model hub here) is replaced by a copy of models/clover-demo under the folder name it gives;
- the conversion runs as written (the one-pass Q4_K_M);
- the server runs as written, on a free port instead of 8080, with what the demo model needs and the 35B does not
  (tests/native/test_agents.py says why: the end-of-turn token biased, a capped answer, thinking off, a context it
  declares);
- the agent line runs as written, with Claude Code asked one question in print mode; it must end its turn.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from clover_dev import REPO_ROOT
from clover_dev.process import free_port, serving
from tests.support.native import skip_or_fail

pytestmark = pytest.mark.native

MARKER = "<!-- walkthrough:"
DEMO_SERVER_FLAGS = ("-np", "1", "-t", "2", "--no-warmup", "--think", "off", "-n", "64", "-s", "7",
                     "--override-kv", "clover_moe.context_length=int:65536")


def walkthrough() -> list[str]:
    """The command lines of README's walkthrough block."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(MARKER)
    block = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    assert block, "no ```sh block after the walkthrough marker"
    return [line for line in block.group(1).splitlines() if line.strip()]


def _local(word: str) -> str:
    """A repository path of the block (.venv/bin/..., build/...) made absolute: the block runs from the checkout."""
    return str(REPO_ROOT / word) if word.startswith((".venv/", "build/")) else word


def _split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def test_the_walkthrough_runs_on_the_demo_model(tmp_path: Path) -> None:
    lines = walkthrough()
    assert [line.split()[0] for line in lines][:3] == ["make", "hf", ".venv/bin/clover-convert"], lines
    claude = REPO_ROOT / "build" / "agents" / "node_modules" / ".bin" / "claude"
    if not claude.exists():
        skip_or_fail(f"{claude} is missing (make agents installs the agent CLIs)")
    assert lines[0] == "make setup"

    # hf download REPO --local-dir DIR: the demo model under DIR's name
    hf = shlex.split(lines[1])
    local_dir = hf[hf.index("--local-dir") + 1]
    shutil.copytree(REPO_ROOT / "models" / "clover-demo", tmp_path / local_dir)

    convert = [_local(w) for w in shlex.split(lines[2])]
    done = subprocess.run(convert, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    gguf = tmp_path / convert[2]
    assert gguf.is_file() and "--outtype" in convert and convert[convert.index("--outtype") + 1] == "Q4_K_M"

    serve = [_local(w) for w in shlex.split(lines[3].rstrip("& "))]
    assert serve[1] == "serve" and "--port" in serve and serve[serve.index("-m") + 1] == convert[2], serve
    serve[serve.index("-m") + 1] = str(gguf)
    port = free_port()
    serve[serve.index("--port") + 1] = str(port)
    log = tmp_path / "serve.log"
    with serving([*serve, "--host", "127.0.0.1", *DEMO_SERVER_FLAGS, "--logit-bias", f"{_end_of_turn()}+20"], port,
                 log_path=log, ready_s=120) as (url, _):
        env, argv = _split_env(shlex.split(lines[4].replace("http://127.0.0.1:8080", url)))
        argv = [_local(w) for w in argv]
        assert Path(argv[0]) == claude, argv
        done = subprocess.run([*argv, "-p", "Say hello.", "--max-turns", "1", "--output-format", "json"],
                              env=os.environ | env | {"HOME": str(tmp_path), "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64",
                                                      "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                                                      "DISABLE_TELEMETRY": "1"},
                              cwd=tmp_path, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        prompts = [int(n) for n in re.findall(r"prompt eval time = .*?/\s+(\d+) tokens", log.read_text())]
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    result = json.loads(done.stdout)
    assert result["is_error"] is False and result["subtype"] == "success", result
    assert prompts and max(prompts) > 10_000, prompts  # the agent's whole first request reached the model


def _end_of_turn() -> int:
    """<|im_end|>'s id in the demo model's vocabulary (the shipped tokenizer)."""
    from clover_common.tokenizer import special_token_ids

    return special_token_ids()["<|im_end|>"]
