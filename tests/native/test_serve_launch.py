"""`clover-cpp serve` is the patched llama-server (clover_cpp/launch.py; docs/serve.md, "clover-cpp serve"):

- launch lines written for llama-server (its README's, and the ones users bring: --jinja, -ngl auto, -fa, -ctk, a
  built-in --chat-template name, ...) start `clover-cpp serve` with llama-server's meaning: the server's /props
  equal those of llama-server started with the same line and the Clover defaults the start-up line names;
- the earlier server's flags become llama-server's (the same /props), or exit 2 with one line naming what replaces
  them;
- LLAMA_ARG_* variables pass through and outrank Clover's defaults, as they outrank llama-server's;
- SIGTERM and Ctrl-C stop it with status 0; its exit status is llama-server's.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from clover_cpp.launch import LOG_LEVELS, WEBUI, launch_line, translate
from clover_dev.process import cli_command
from tests.support.chat import child_env
from tests.support.native import llama_server
from tests.support.serve import clover_serve, get

pytestmark = pytest.mark.native

SMALL = ("-c", "1024", "-np", "1", "-t", "2", "--no-warmup")
SPEC = ("--spec-type", "ngram-mod,draft-clover")
CLOVER_DEFAULTS = (*SPEC, "--path", str(WEBUI))  # what the start-up line says it adds for the demo
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def test_the_earlier_flags_become_llama_servers(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    args, model, has_spec = translate(["-m", "x.gguf", "--think", "off", "--chat-template", str(template),
                                       "--chat-template=chatml", "--max-tokens", "9", "--max-block-size", "0",
                                       "--max-block-size=16", "--cache-ram", "12.5", "--log-level", "warning",
                                       "--prefill-chunk", "64", "--prefill-chunk", "0", "-ngl", "auto", "-n", "-1",
                                       "--graph-cache", "6"])
    assert (model, has_spec) == ("x.gguf", set())
    assert args == ["-m", "x.gguf", "--reasoning", "off", "--chat-template-file", str(template),
                    "--chat-template", "chatml", "--n-predict", "9", "--max-block-size", "16", "--cache-ram", "13",
                    "--log-verbosity", LOG_LEVELS["warning"], "--batch-size", "64", "-ngl", "auto", "-n", "-1",
                    "--graph-cache", "6"]
    assert translate(["--model=y.gguf", "--spec-type=ngram-mod", "--path", "p", "--no-webui"])[1:] == \
        ("y.gguf", {"spec-type", "path", "webui"})


def test_clover_defaults_yield_to_the_line_and_the_environment(demo_gguf: Path) -> None:
    from clover_cpp.launch import _clover_info

    path = ["--path", str(WEBUI)]
    m = ["-m", str(demo_gguf)]
    assert launch_line(m, {}, _clover_info).added == list(CLOVER_DEFAULTS)
    assert launch_line([], {"LLAMA_ARG_MODEL": str(demo_gguf)}, _clover_info).added == list(CLOVER_DEFAULTS)
    assert launch_line([*m, "--spec-type", "ngram-simple"], {}, _clover_info).added == path
    assert launch_line(m, {"LLAMA_ARG_SPEC_TYPE": "none"}, _clover_info).added == path
    assert launch_line([*m, "--no-webui"], {}, _clover_info).added == list(SPEC)
    assert launch_line([*m, "--path", "/srv/ui"], {}, _clover_info).added == list(SPEC)
    assert launch_line(m, {"LLAMA_ARG_STATIC_PATH": "/srv/ui"}, _clover_info).added == list(SPEC)
    trunk = _clover_info(str(demo_gguf))
    trunk.has_block_diffusion = 0  # what libclover reports for a trunk-only file
    assert launch_line(m, {}, lambda _: trunk).added == ["--spec-type", "ngram-mod", *path]
    assert launch_line(m, {}, lambda _: None).added == path  # not a Clover GGUF: llama-server's own defaults


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli_command("serve", *args), capture_output=True, text=True, env=child_env(), timeout=60)


@pytest.mark.parametrize("flag", ["--bd", "--checkpoint-every", "--max-body-bytes", "--max-prompt-chars"])
def test_refused_flags_exit_2_naming_the_replacement(demo_gguf: Path, flag: str) -> None:
    done = _run("-m", str(demo_gguf), flag, "4")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"clover-cpp: error: {flag} is not a llama-server option: "), lines


@pytest.mark.parametrize("args, fragment", [(("-m", "/nonexistent.gguf"), "-m/--model /nonexistent.gguf"),
                                            (("--cache-ram", "nan"), "--cache-ram"),
                                            (("--think", "maybe"), "--think"),
                                            (("--log-level", "loud"), "--log-level"),
                                            (("--think",), "--think needs a value")])
def test_bad_earlier_flags_exit_2(demo_gguf: Path, args: tuple[str, ...], fragment: str) -> None:
    done = _run(*(args if args[0] == "-m" else ("-m", str(demo_gguf), *args)))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and fragment in lines[0], done.stderr


def _props(url: str) -> dict[str, Any]:
    props = get(url + "/props")
    for key in ("model_path", "build_info", "media_marker"):  # a random marker per process
        props.pop(key, None)
    return props


# Launch lines written for llama-server: its README's that load a local -m file (tools/server/README.md:
# `-c 2048`, `--ui-config ...`), and those the earlier server refused (--jinja, -ngl auto, -n -1, -s -1, a built-in
# template name, --chat-template-file, --min-p, --reasoning-format, -fa, -ctk)
LLAMA_SERVER_LINES = [
    ("-c", "2048"),
    ("--ui-config", '{"pasteLongTextToFileLen": 0, "renderUserContentAsMarkdown": true}'),
    ("--jinja", "-ngl", "auto", "-n", "-1", "-s", "-1"),
    ("--chat-template", "chatml", "--min-p", "0.1", "--reasoning-format", "deepseek"),
    ("--chat-template-file", "{TEMPLATE}", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"),
]


@pytest.mark.parametrize("line", LLAMA_SERVER_LINES, ids=lambda line: " ".join(line)[:40])
def test_llama_server_launch_lines_mean_the_same(demo_gguf: Path, tmp_path: Path, line: tuple[str, ...]) -> None:
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    line = tuple(str(template) if a == "{TEMPLATE}" else a for a in line)
    with clover_serve(demo_gguf, *SMALL, *line) as (url, _, log):
        ours = _props(url)
        assert f"Clover's defaults added: {' '.join(CLOVER_DEFAULTS)}" in log.read_text()
    with llama_server(demo_gguf, *SMALL, *line, *CLOVER_DEFAULTS) as url:
        assert ours == _props(url)


def test_the_earlier_flags_mean_llama_servers(demo_gguf: Path, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    with clover_serve(demo_gguf, *SMALL, "--think", "off", "--max-tokens", "7", "--cache-ram", "12.5",
                      "--prefill-chunk", "64", "--chat-template", str(template), "--max-block-size", "16",
                      "--alias", "demo") as (url, _, _):
        ours = _props(url)
        assert [m["id"] for m in get(url + "/v1/models")["data"]] == ["demo"]
    with llama_server(demo_gguf, *SMALL, "--reasoning", "off", "-n", "7", "--cache-ram", "13", "-b", "64",
                      "--chat-template-file", str(template), "--max-block-size", "16", "--alias", "demo",
                      *CLOVER_DEFAULTS) as url:
        assert ours == _props(url)


def test_llama_arg_variables_pass_through_and_outrank_the_defaults(demo_gguf: Path) -> None:
    env = {"LLAMA_ARG_ALIAS": "from-env", "LLAMA_ARG_SPEC_TYPE": "ngram-mod", "LLAMA_ARG_CTX_SIZE": "768"}
    with clover_serve(demo_gguf, "-np", "1", "-t", "2", "--no-warmup", "-lv", "4", env=env) as (url, _, log):
        assert [m["id"] for m in get(url + "/v1/models")["data"]] == ["from-env"]
        assert get(url + "/props")["default_generation_settings"]["n_ctx"] == 768
        text = log.read_text()
        drafters = re.findall(r"adding speculative implementation '([^']+)'", text)
        assert drafters == ["ngram-mod"], text[-3000:]
        assert f"Clover's defaults added: --path {WEBUI};" in text
        assert "context 768 tokens (LLAMA_ARG_CTX_SIZE)" in text


def test_the_trained_context_is_the_default_and_said(demo_gguf: Path) -> None:
    from clover_native import libclover

    trained = libclover.read_model_info(str(demo_gguf)).n_ctx_train
    with clover_serve(demo_gguf, "-np", "1", "-t", "2", "--no-warmup") as (url, _, log):
        assert get(url + "/props")["default_generation_settings"]["n_ctx"] == trained
        assert f"the model's trained context of {trained} tokens (-c 0)" in log.read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_stop_it_with_status_0(demo_gguf: Path, sig: signal.Signals) -> None:
    with clover_serve(demo_gguf, *SMALL, alive_at_end=False) as (url, proc, _):
        start = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - start < 10


def test_its_exit_status_and_errors_are_llama_servers(demo_gguf: Path) -> None:
    from tests.support.native import native_tool

    ours = _run("-m", str(demo_gguf), "--no-such-flag")
    theirs = subprocess.run([str(native_tool("llama-server")), "-m", str(demo_gguf), "--no-such-flag"],
                            capture_output=True, text=True, timeout=60)
    assert ours.returncode == theirs.returncode == 2  # a usage error (patch server-bad-command-line-exits-2)
    assert theirs.stderr.strip().splitlines()[-1] in ours.stderr
    assert "--no-such-flag" in theirs.stderr.strip().splitlines()[-1]
    bad_value = _run("-m", str(demo_gguf), "--max-connections", "-5")
    assert bad_value.returncode == 2  # llama-server's message: the option, the error, and the option's usage
    assert 'error while handling argument "--max-connections": --max-connections must be' in bad_value.stderr


def test_help_is_llama_servers(demo_gguf: Path) -> None:
    done = _run("--help")
    assert done.returncode == 0 and "--spec-type" in done.stdout and "--chat-template-file" in done.stdout


def test_the_context_line_reads_the_model_once_and_every_form_of_c(demo_gguf: Path) -> None:
    from clover_cpp.launch import _clover_info, _context_line

    reads: list[str] = []

    def read_info(path: str) -> object | None:
        reads.append(path)
        return _clover_info(path)

    for c in (["-c", "768"], ["--ctx-size", "768"], ["--ctx-size=768"]):
        assert _context_line(launch_line(["-m", str(demo_gguf), *c], {}, read_info), {}).startswith(
            "context 768 tokens (-c)"), c
    line = launch_line(["-m", str(demo_gguf)], {}, read_info)
    assert "trained context of 32768 tokens (-c 0)" in _context_line(line, {})
    assert reads == [str(demo_gguf)] * 4
