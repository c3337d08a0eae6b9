"""Upstream llama.cpp runs our trunk files: the demo model converted with `clover-convert --bd-sidecar` (the trunk is
what llama.cpp's own Clover converter writes; docs/gguf-format.md, "Interchange with llama.cpp's own Clover GGUFs"),
at f16 and quantized to Q4_K_M, loaded by upstream llama.cpp b12211 as the npm package @wllama/wllama 3.13.0 builds
it to wasm (`make setup` installs it into build/wllama), in headless Chromium. Upstream's greedy completion is our
engine's `ar` text on the same file, token for token.

One difference by design: upstream's sampler may pick the mask token, which is in the vocabulary, and ours never
does (spec section 4). Greedy decoding of these prompts never has it on top; the test checks that our answer holds
no mask token, so that a difference there would be named, not mistaken for a bug.
"""

from __future__ import annotations

import functools
import http.server
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clover_dev import REPO_ROOT, VENV_PYTHON
from clover_dev.convert import clover_convert
from tests.support.browser import headless_chromium
from tests.support.native import skip_or_fail
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native

WLLAMA = REPO_ROOT / "build" / "wllama" / "node_modules" / "@wllama" / "wllama"
PROMPTS = ["def fibonacci(n):\n    if n < 2:\n", "import os\n\n\ndef list_files(path):\n"]
N_TOKENS = 32
TIMEOUT_S = 180

PAGE = """<!doctype html><meta charset="utf-8"><title>wllama interop</title>
<script type="module">
import { Wllama } from './wllama/esm/index.js';
window.complete = async (model, prompts, nTokens) => {
  const wllama = new Wllama({ default: './wllama/esm/wasm/wllama.wasm' }, { suppressNativeLog: true });
  await wllama.loadModelFromUrl(model, { n_ctx: 512, n_threads: 1, n_gpu_layers: 0, useCache: false });
  const out = [];
  for (const prompt of prompts) {
    const r = await wllama.createCompletion({ prompt, max_tokens: nTokens, temperature: 0 });
    out.push({ text: r.choices[0].text, tokens: r.usage.completion_tokens });
  }
  await wllama.exit();
  return out;
};
window.ready = true;
</script>
"""


class _Files(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".js": "text/javascript", ".wasm": "application/wasm", ".gguf": "application/octet-stream"}

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def site(module_tmp: MkTemp) -> Iterator[tuple[str, dict[str, Path]]]:
    """A local web server for the page, upstream's wasm build and the trunk files: (its URL, trunk files by type)."""
    if not (WLLAMA / "esm" / "wasm" / "wllama.wasm").is_file():
        skip_or_fail(f"{WLLAMA} is missing (`make setup` installs @wllama/wllama)")
    root = module_tmp("wllama-site")
    f16 = clover_convert(REPO_ROOT / "models" / "clover-demo", root / "demo-f16.gguf", "f16", "--bd-sidecar")
    q4 = root / "demo-Q4_K_M.gguf"
    subprocess.run([str(VENV_PYTHON.parent / "clover-quantize"), str(f16), str(q4), "Q4_K_M"], check=True,
                   capture_output=True, timeout=300)
    (root / "index.html").write_text(PAGE, encoding="utf-8")
    (root / "wllama").symlink_to(WLLAMA)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Files, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", {"f16": f16, "Q4_K_M": q4}
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium(TIMEOUT_S) as drv:
        yield drv


def _upstream(browser: Any, url: str, model: str) -> list[dict[str, Any]]:
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url + "/index.html")
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return window.ready === true"))
    result = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "window.complete(arguments[0], arguments[1], arguments[2]).then(done, e => done({error: String(e)}));",
        f"{url}/{model}", PROMPTS, N_TOKENS)
    assert isinstance(result, list), result
    return result


def _ours(path: Path) -> list[dict[str, Any]]:
    from clover_cpp import Model

    out = []
    with Model(str(path), n_ctx=512, n_threads=1) as model:
        mask = model.info.mask_token_id
        for prompt in PROMPTS:
            run = model.run(prompt, mode="ar", max_tokens=N_TOKENS)
            assert mask not in run.tokens, "our greedy answer holds the mask token"
            # llama.cpp's completion_tokens also counts the end-of-generation token an answer stops at, which our
            # tokens leave out
            ended = len(run.tokens) < N_TOKENS
            out.append({"text": model.detokenize(run.tokens, special=False), "tokens": len(run.tokens) + ended})
            model.reset()
    return out


@pytest.mark.parametrize("kind", ["f16", "Q4_K_M"])
def test_upstream_gives_ar_text_on_our_trunk(site: tuple[str, dict[str, Path]], browser: Any, kind: str) -> None:
    url, files = site
    theirs = _upstream(browser, url, files[kind].name)
    ours = _ours(files[kind])
    assert theirs == ours
    assert all(r["tokens"] > 4 and r["text"].strip() for r in ours), ours
