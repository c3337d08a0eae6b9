"""`clover-cpp serve`'s web chat at ``/`` (clover_cpp/webui/, which the launcher gives llama-server as --path;
docs/serve.md "Web chat") in a real headless browser: Debian's chromium driven by selenium, against a live
llama-server on the shipped trained model (models/clover-demo, converted to f16), never a mocked engine.

The page loads and answers a chat (text, the reasoning block, the stats); the block canvas fills during a
diffusion answer (the stream is held at one canvas frame to look at the page mid-answer); Stop keeps the partial
answer and New chat starts an empty conversation; with --api-key the page
asks for the key and then works; --no-webui gives a 404. A missing chromium or chromedriver is a skip, and a
failure under CLOVER_REQUIRE_NATIVE=1 (`make setup` installs them). CLOVER_WEBUI_SCREENSHOTS=DIR also saves the
docs' screenshots there (``CLOVER_WEBUI_SCREENSHOTS=docs/img pytest tests/surfaces/test_webui.py``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By  # a test dependency (pyproject [test]): missing, the suite fails
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from clover_dev import REPO_ROOT
from clover_dev.convert import clover_convert
from tests.support.browser import headless_chromium
from tests.support.serve import clover_serve, http, no_end_of_thinking, sse_chunks
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native  # a live server (skipped without the build; a failure in CI)

DEMO = REPO_ROOT / "models" / "clover-demo"
MODEL_ID = "clover-demo"
KEY = "webui-test-key"
PROMPT = "Write a function that reads a file and counts its lines."
TIMEOUT_S = 30

# Records the body of every chat request the page sends (window.__bodies), to check what the conversation holds.
RECORD_JS = """
window.__bodies = [];
const send = window.fetch;
window.fetch = (...args) => {
  if (String(args[0]).includes('chat/completions')) window.__bodies.push(JSON.parse(args[1].body));
  return send(...args);
};
"""

# Wraps the page's fetch so that a chat stream stops at one canvas frame (after a block was committed, a later step
# of its window than the first, a quarter of the cells or more filled and some still masked) until
# window.__hold.release() is called: the test looks at the page mid-answer, whatever the engine's speed. The page
# itself is unchanged.
HOLD_JS = """
const hold = window.__hold = {held: false, frame: null, release: null};
const original = window.fetch;
window.fetch = async (...args) => {
  const resp = await original(...args);
  if (!String(args[0]).includes('chat/completions') || !resp.ok) return resp;
  const reader = resp.body.getReader(), decoder = new TextDecoder(), encoder = new TextEncoder();
  let buffer = '', sawContent = false, armed = true, before = 0;
  const body = new ReadableStream({async pull(ctrl) {
    const {value, done} = await reader.read();
    if (done) { if (buffer) ctrl.enqueue(encoder.encode(buffer)); ctrl.close(); return; }
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf('\\n\\n')) >= 0) {
      const event = buffer.slice(0, end + 2);
      buffer = buffer.slice(end + 2);
      ctrl.enqueue(encoder.encode(event));
      const data = event.trim().replace(/^data: /, '');
      if (!data.startsWith('{')) continue;
      const chunk = JSON.parse(data);
      if ((chunk.choices || []).some((c) => c.delta && c.delta.content)) { sawContent = true; before = 0; }
      const cells = chunk.canvas && chunk.canvas.cells;
      if (!armed || !cells) continue;
      const filled = cells.filter((c) => c !== null).length, earlier = before;
      before = filled;
      if (sawContent && earlier > 0 && filled > earlier && filled < cells.length && 4 * filled >= cells.length) {
        armed = false;
        hold.frame = cells;
        await new Promise((resolve) => { hold.release = resolve; hold.held = true; });
      }
    }
  }});
  return new Response(body, {status: resp.status, headers: resp.headers});
};
"""


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def demo_gguf(module_tmp: MkTemp) -> Path:
    return clover_convert(DEMO, module_tmp("webui") / f"{MODEL_ID}.gguf", "f16")


# the chat-trained demo answers briefly and closes its reasoning at once: the page's tests want answers that run to
# max_tokens (a diffusion answer longer than a block) and reasoning when thinking is on
SERVER_ARGS = ("-c", "4096", "-np", "1", "-t", "2", "--no-warmup", "--alias", MODEL_ID, "--ignore-eos",
               *no_end_of_thinking())


@pytest.fixture(scope="module")
def server(demo_gguf: Path) -> Iterator[str]:
    with clover_serve(demo_gguf, *SERVER_ARGS) as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium(TIMEOUT_S, "--window-size=1280,900", "--force-device-scale-factor=1") as drv:
        yield drv


def _screenshot(driver: Any, tmp_path: Path, name: str) -> None:
    """Into tmp_path always (the call is exercised); into $CLOVER_WEBUI_SCREENSHOTS too when set (the docs')."""
    driver.save_screenshot(str(tmp_path / name))
    folder = os.environ.get("CLOVER_WEBUI_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / name, Path(folder) / name)


# ------------------------------------------------------------------------------------------ helpers
def _wait(driver: Any, condition: Any, timeout: float = TIMEOUT_S) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def _open(driver: Any, url: str, ready: bool = True) -> None:
    """The page with default settings (localStorage cleared), its chat requests recorded (RECORD_JS), connected to
    the server when ``ready``."""
    driver.get(url + "/")
    driver.execute_script("localStorage.clear()")
    driver.refresh()
    driver.execute_script(RECORD_JS)
    if ready:
        _wait(driver, lambda d: d.execute_script("return document.body.dataset.ready === '1'"))


def _settings(driver: Any, **values: Any) -> None:
    """Set the settings panel's fields by id (``max_tokens`` sets #max-tokens)."""
    driver.execute_script("""
        for (const [id, value] of Object.entries(arguments[0])) {
          const input = document.getElementById(id);
          if (input.type === 'checkbox') input.checked = value; else input.value = String(value);
        }""", {k.replace("_", "-"): v for k, v in values.items()})


def _answers(driver: Any) -> list[Any]:
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def _send(driver: Any, text: str) -> int:
    """Type ``text`` and press Enter; the index of the answer it starts."""
    n = len(_answers(driver))
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    _wait(driver, lambda d: len(_answers(d)) > n)
    return n


def _held_diffusion_answer(driver: Any, url: str) -> int:
    """A fresh page sends PROMPT in diffusion, its stream held at one canvas frame (HOLD_JS); the answer's index."""
    _open(driver, url)
    driver.execute_script(HOLD_JS)
    _settings(driver, mode="diffusion", thinking=False, max_tokens=128)
    index = _send(driver, PROMPT)
    _wait(driver, lambda d: d.execute_script("return window.__hold.held")
          or _answers(d)[index].get_attribute("data-state") != "streaming")
    assert driver.execute_script("return window.__hold.held"), "no canvas frame to hold after a committed block"
    return index


def _finished(driver: Any, index: int) -> Any:
    _wait(driver, lambda d: _answers(d)[index].get_attribute("data-state") != "streaming")
    answer = _answers(driver)[index]
    errors = answer.find_elements(By.CSS_SELECTOR, ".error")
    assert answer.get_attribute("data-state") == "done", [e.text for e in errors]
    return answer


def _stat(answer: Any, name: str) -> str:
    return answer.find_element(By.CSS_SELECTOR, f'.stat[data-stat="{name}"]').text


# ------------------------------------------------------------------------------------------ tests
def test_page_answers_with_reasoning_and_stats(server: str, browser: Any, tmp_path: Path) -> None:
    status, headers, page = http(server + "/")
    assert status == 200 and headers["content-type"].startswith("text/html") and b'src="app.js"' in page
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        status, headers, _ = http(f"{server}/{name}")
        assert status == 200 and headers["content-type"].startswith(kind)

    _open(browser, server)
    assert browser.title == "clover-cpp chat"
    assert browser.find_element(By.ID, "model").text == MODEL_ID
    _settings(browser, mode="auto", thinking=True, max_tokens=40)
    first = _finished(browser, _send(browser, PROMPT))
    reasoning = first.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert reasoning.is_displayed() and reasoning.find_element(By.CSS_SELECTOR, ".reasoning-text").get_attribute(
        "textContent").strip(), "thinking on: the demo model's text is reasoning"

    _settings(browser, thinking=False, max_tokens=48)
    second = _finished(browser, _send(browser, "Now add a docstring."))
    assert second.find_element(By.CSS_SELECTOR, ".content").text.strip(), "no answer text"
    assert not second.find_element(By.CSS_SELECTOR, "details.reasoning").is_displayed()
    assert _stat(second, "mode").startswith("auto")
    assert _stat(second, "tok-s").endswith("tok/s") and float(_stat(second, "tok-s").split()[0]) > 0
    assert float(_stat(second, "tpf").split()[1]) >= 1.0
    passes = int(_stat(second, "passes").split()[0])
    tokens = int(_stat(second, "tokens").split()[0])
    assert 0 < passes <= tokens <= 48
    sent = browser.execute_script("return window.__bodies")[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"] and sent[0]["content"] == PROMPT, \
        "the second turn's request holds the first turn (the page keeps the conversation)"
    _screenshot(browser, tmp_path, "webui-chat.png")


def test_canvas_fills_during_a_diffusion_answer(server: str, browser: Any, tmp_path: Path) -> None:
    index = _held_diffusion_answer(browser, server)
    answer = _answers(browser)[index]
    assert answer.get_attribute("data-state") == "streaming"
    frame = browser.execute_script("return window.__hold.frame")
    cells = answer.find_elements(By.CSS_SELECTOR, ".canvas .cell")
    assert len(cells) == len(frame) == 32  # the demo model's block size
    masked = answer.find_elements(By.CSS_SELECTOR, ".canvas .cell.masked")
    filled = answer.find_elements(By.CSS_SELECTOR, ".canvas .cell.filled")
    assert len(masked) == frame.count(None) and len(filled) == len(frame) - frame.count(None)
    assert masked and filled and answer.find_elements(By.CSS_SELECTOR, ".canvas .cell.new")
    assert "window" in answer.find_element(By.CSS_SELECTOR, ".canvas-info").text
    _screenshot(browser, tmp_path, "webui-canvas.png")

    browser.execute_script("window.__hold.release()")
    answer = _finished(browser, index)
    assert int(answer.get_attribute("data-canvas-mixed")) >= 1
    assert int(answer.get_attribute("data-canvas-frames")) >= int(_stat(answer, "passes").split()[0]) // 2
    assert _stat(answer, "mode").startswith("diffusion B=32")


def test_stop_keeps_the_partial_answer_and_new_chat_starts_afresh(server: str, browser: Any) -> None:
    """Stop ends the answer where it is and keeps it (the stream is held mid-answer, so Stop comes before the end);
    New chat empties the page and the conversation: its next request holds only the new prompt."""
    index = _held_diffusion_answer(browser, server)
    stop, send = browser.find_element(By.ID, "stop"), browser.find_element(By.ID, "send")
    assert stop.is_displayed() and not send.is_displayed()
    shown = _answers(browser)[index].find_element(By.CSS_SELECTOR, ".content").text
    stop.click()
    browser.execute_script("window.__hold.release()")
    _wait(browser, lambda d: _answers(d)[index].get_attribute("data-state") != "streaming")
    answer = _answers(browser)[index]
    assert answer.get_attribute("data-state") == "stopped"
    kept = answer.find_element(By.CSS_SELECTOR, ".content").text
    assert shown and kept.startswith(shown), (shown, kept)
    assert send.is_displayed() and not stop.is_displayed()

    browser.find_element(By.ID, "new-chat").click()
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg")
    _settings(browser, mode="ar", max_tokens=4)
    _finished(browser, _send(browser, PROMPT))
    sent = browser.execute_script("return window.__bodies")[-1]["messages"]
    assert sent == [{"role": "user", "content": PROMPT}], "New chat: the request holds the new prompt only"


def test_canvas_chunks_are_opt_in(server: str) -> None:
    """The stream carries ``canvas`` chunks (a piece or null per cell) only when asked (``return_canvas``)."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": PROMPT}], "stream": True, "mode": "diffusion",
            "max_tokens": 32, "chat_template_kwargs": {"enable_thinking": False}}
    plain = sse_chunks(http(server + "/v1/chat/completions", body)[2])
    assert plain and not any("canvas" in c for c in plain)
    chunks = sse_chunks(http(server + "/v1/chat/completions", body | {"return_canvas": True})[2])
    frames = [c["canvas"]["cells"] for c in chunks if "canvas" in c]
    assert frames and all(len(cells) == 32 for cells in frames)
    assert any(None in cells for cells in frames)
    assert all(isinstance(p, str) for cells in frames for p in cells if p is not None)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def test_api_key_is_asked_for_and_sent(demo_gguf: Path, browser: Any) -> None:
    with clover_serve(demo_gguf, *SERVER_ARGS, "--api-key", KEY) as (url, _, _):
        for path in ("/", "/app.js", "/style.css"):
            assert http(url + path)[0] == 200, f"{path} must load without the key, as llama-server's UI"
        assert http(url + "/v1/models")[0] == 401
        _open(browser, url, ready=False)
        panel = browser.find_element(By.ID, "key-panel")
        _wait(browser, lambda d: panel.is_displayed())
        browser.find_element(By.ID, "api-key").send_keys("wrong-key", Keys.ENTER)
        _wait(browser, lambda d: "refused" in d.find_element(By.ID, "key-error").text and panel.is_displayed())
        browser.find_element(By.ID, "api-key").send_keys(KEY, Keys.ENTER)
        _wait(browser, lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
        assert not panel.is_displayed()
        assert browser.execute_script("return sessionStorage.getItem('clover-api-key')") == KEY
        _settings(browser, mode="ar", thinking=False, max_tokens=8)
        answer = _finished(browser, _send(browser, PROMPT))
        assert int(_stat(answer, "tokens").split()[0]) > 0


def test_no_webui_gives_404(demo_gguf: Path) -> None:
    with clover_serve(demo_gguf, *SERVER_ARGS, "--no-webui") as (url, _, _):
        for path in ("/", "/app.js"):
            assert http(url + path)[0] == 404
        assert http(url + "/health")[0] == 200
