"""`clover-cpp serve`'s monitoring endpoints, llama-server's own (docs/serve.md, "Logprobs and metrics"): ``GET
/props``, ``POST /props``, ``GET /slots`` and ``GET /metrics``, on a live server over the tiny GGUF (never a mocked
engine).

Each answer is checked key by key against what llama-server's tools/server/server-context.cpp (get_res_props,
server_slot::to_json) and server-task.cpp (task_params::to_json, server_task_result_metrics::to_metrics) send, with
Clover's fields (the decoding settings, ``gen_*`` metrics), and its values against the truth: the command line, the
model's template and vocabulary, and the usage and ``timings`` of the requests just made. A second server without
the switches (--no-slots, no --metrics, no --props) and with an API key gives llama-server's 501s and 401s.
Process-Start-Time-Unix is Unix time (patch server-process-start-time-is-unix-time; a strict xfail held it before).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.chat import Reference
from tests.support.serve import MODEL_ID, THINK_OFF, auth, clover_serve, get, http, post_raw

pytestmark = pytest.mark.native  # live servers (skipped without the build; a failure in CI)

KEY = "monitor-key"
# the main server: two slots of 2048 positions, the sampling and decoding defaults a request takes; blocks of 16 need
# --max-block-size (the tiny model's own is 8)
SERVER_ARGS = ("-np", "2", "-c", "4096", "-t", "1", "--no-warmup", "--max-block-size", "32", "--block-size", "16",
               "--threshold", "0.5", "--temp", "0.5", "--top-k", "5", "--top-p", "0.9", "-s", "7", "-n", "48",
               "--metrics", "--props")
LONG = {"mode": "diffusion", "block_size": 16, "threshold": 1.0, "ignore_eos": True, **THINK_OFF}  # ~1 token/pass

# server-context.cpp's get_res_props (chat_template_tool_use only for a template with a tool_use variant)
PROPS = {"default_generation_settings", "total_slots", "model_alias", "model_ftype", "model_path", "modalities",
         "media_marker", "endpoint_slots", "endpoint_props", "endpoint_metrics", "ui", "ui_settings", "chat_template",
         "chat_template_caps", "bos_token", "eos_token", "build_info", "is_sleeping", "cors_proxy_enabled"}
# server-task.cpp's task_params::to_json(true): /props' defaults and /slots' params (without --slots-debug), with
# Clover's penalty_response_only, grammar_first and decoding settings (mode, block_size, threshold, coreset_top_p)
PARAMS = {
    "seed", "temperature", "dynatemp_range", "dynatemp_exponent", "top_k", "top_p", "min_p", "top_n_sigma",
    "xtc_probability", "xtc_threshold", "typical_p", "repeat_last_n", "repeat_penalty", "presence_penalty",
    "frequency_penalty", "penalty_response_only", "grammar_first", "mode", "block_size", "threshold", "coreset_top_p",
    "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "mirostat", "mirostat_tau",
    "mirostat_eta", "adaptive_target", "adaptive_decay", "max_tokens", "n_predict", "n_keep", "n_discard",
    "ignore_eos", "stream", "n_probs", "min_keep", "chat_format", "reasoning_format", "reasoning_in_content",
    "generation_prompt", "samplers", "speculative.types", "timings_per_token", "post_sampling_probs",
    "backend_sampling", "lora"}
# llama.cpp's default sampler chain (common_params_sampling; the tiny GGUF sets no general.sampling.sequence)
SAMPLERS = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
# server_slot::to_json: a slot that never ran a task has only its own fields
IDLE_SLOT = {"id", "n_ctx", "speculative", "is_processing"}
SLOT = IDLE_SLOT | {"id_task", "n_prompt_tokens", "n_prompt_tokens_processed", "n_prompt_tokens_cache", "params",
                    "next_token"}
NEXT_TOKEN = {"has_next_token", "has_new_line", "n_remain", "n_decoded"}
# server-task.cpp's server_task_result_metrics::to_metrics: name -> (TYPE, HELP); README "GET /metrics" lists the
# llamacpp ones, patch 0032 adds gen_*
METRICS = {
    "llamacpp:prompt_tokens_total": ("counter", "Number of prompt tokens processed, excluding cached tokens"),
    "llamacpp:prompt_tokens_cached_total": ("counter", "Number of prompt tokens reused from the cache"),
    "llamacpp:prompt_seconds_total": ("counter", "Total time spent processing prompts"),
    "llamacpp:tokens_predicted_total": ("counter", "Number of generation tokens processed"),
    "llamacpp:tokens_predicted_seconds_total": ("counter", "Total time spent generating tokens"),
    "llamacpp:n_decode_total": ("counter", "Total number of llama_decode() calls, excluding speculative decoding "
                                           "and multimodal decoding"),
    "llamacpp:n_tokens_max": ("counter", "Largest observed sequence length (prompt + generation)"),
    "llamacpp:spec_decode_num_draft_tokens_total": ("counter", "Speculative: Total draft tokens generated"),
    "llamacpp:spec_decode_num_accepted_tokens_total": ("counter",
                                                       "Speculative: Total draft tokens accepted by the target model"),
    "llamacpp:spec_decode_num_drafts_total": ("counter", "Speculative: Total speculative decoding verification steps"),
    "llamacpp:gen_causal_passes_total": ("counter", "Causal passes of the generations (a sampled token with its "
                                                    "drafts, a diffusion block's commit)"),
    "llamacpp:gen_block_passes_total": ("counter", "Block passes of the generations: block-diffusion steps (a "
                                                   "drafter's own passes are not counted)"),
    "llamacpp:prompt_tokens_seconds": ("gauge", "Average prompt throughput in tokens/s"),
    "llamacpp:predicted_tokens_seconds": ("gauge", "Average generation throughput in tokens/s"),
    "llamacpp:requests_processing": ("gauge", "Number of requests processing"),
    "llamacpp:requests_deferred": ("gauge", "Number of requests deferred"),
    "llamacpp:n_busy_slots_per_decode": ("gauge", "Average number of busy slots per llama_decode() call"),
    "llamacpp:gen_tokens_per_pass": ("gauge", "Generated tokens per pass of the generations, causal and block (TPF), "
                                              "since the start"),
}
PER_POSITION = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"  # labelled, once a speculative request ran


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[str]:
    with clover_serve(tiny_gguf, *SERVER_ARGS) as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def bare(tiny_gguf: Path) -> Iterator[str]:
    """The switches left off, and an API key; llama-server's defaults otherwise."""
    with clover_serve(tiny_gguf, "-t", "1", "--no-warmup", "--no-slots", "--api-key", KEY) as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client: Any, content: str, max_tokens: int, **extra: Any) -> Any:
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": content}],
                                          max_tokens=max_tokens, temperature=0, extra_body={**THINK_OFF, **extra})


def _until(probe: Callable[[], Any], ok: Callable[[Any], bool], what: str, timeout: float = 60) -> Any:
    """Call ``probe`` until ``ok(result)``: a slot and the counters are updated as the answer goes out."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if ok(got):
            return got
        assert time.monotonic() < deadline, f"{what}: {got}"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------ /props
def test_props_as_llama_server(server: str, tiny_gguf: Path, ref: Reference) -> None:
    """get_res_props' fields, with the values of this server's command line and model."""
    props = get(server + "/props")
    assert set(props) == PROPS
    assert props["total_slots"] == 2
    assert props["model_alias"] == props["model_path"] == str(tiny_gguf) and props["model_ftype"] == "all F32"
    assert props["chat_template"] == ref.template.removesuffix("\n")  # as Jinja reads it: less the final newline
    assert props["chat_template_caps"] == {  # the Qwen3.5 family's: tools, calls, typed content, one system turn first
        "supports_object_arguments": True, "supports_parallel_tool_calls": True, "supports_preserve_reasoning": False,
        "supports_reasoning_effort": False, "supports_string_content": True, "supports_system_role": True,
        "supports_tool_calls": True, "supports_tools": True, "supports_typed_content": True,
        "supports_later_system_messages": False}
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert re.fullmatch(r"<__media_\w+__>", props["media_marker"]), props["media_marker"]
    assert props["is_sleeping"] is False and props["cors_proxy_enabled"] is False and props["ui_settings"] == {}
    assert (props["endpoint_slots"], props["endpoint_metrics"], props["endpoint_props"]) == (True, True, True)
    assert props["ui"] is True and http(server + "/")[0] == 200  # the launcher's --path: the web chat
    assert props["eos_token"] == ref.tokenizer.id_to_token(ref.model.config.eos_token_ids[0]) == "<|im_end|>"
    assert isinstance(props["bos_token"], str)  # none in the GGUF: llama.cpp's default for its vocabulary type
    answer = post_raw(server + "/v1/chat/completions", json.dumps({
        "model": MODEL_ID, "max_tokens": 1, **THINK_OFF, "messages": [{"role": "user", "content": "x"}]}).encode())[1]
    assert props["build_info"] and answer["system_fingerprint"] == props["build_info"]

    settings = props["default_generation_settings"]
    assert set(settings) == {"params", "n_ctx"} and settings["n_ctx"] == 2048  # -c 4096 over -np 2
    params = settings["params"]
    assert set(params) == PARAMS
    assert (params["seed"], params["top_k"]) == (7, 5)
    assert (params["top_p"], params["temperature"]) == pytest.approx((0.9, 0.5))
    assert params["samplers"] == SAMPLERS and params["ignore_eos"] is False and params["stream"] is False
    # Clover's penalties count the response only, all of it (tests/native/test_server_sampling.py)
    assert (params["penalty_response_only"], params["repeat_last_n"]) == (True, -1)

    assert post_raw(server + "/props", b"{}") == (200, {"success": True})  # --props: nothing to change yet


def test_props_give_the_request_defaults_of_the_command_line(server: str) -> None:
    """The defaults a request without those fields gets (patch server-props-show-the-request-defaults: before,
    n_predict -1, block_size 0 and threshold null; the web chat reads its block size and threshold here)."""
    params = get(server + "/props")["default_generation_settings"]["params"]
    assert (params["n_predict"], params["mode"], params["block_size"], params["threshold"]) == (48, "auto", 16, 0.5)


# ------------------------------------------------------------------------------------------ /slots
def _slots(url: str, query: str = "") -> tuple[int, Any]:
    status, _, body = http(url + "/slots" + query)
    return status, json.loads(body)


def _check_slot_shape(slot: dict[str, Any], i: int) -> None:
    """A slot that never ran a task has only its own fields (server_slot::to_json); one that did, its task's."""
    assert slot["id"] == i and slot["n_ctx"] == 2048
    assert slot["speculative"] is True  # the launcher's --spec-type gives every slot its drafters
    if "id_task" not in slot:
        assert set(slot) == IDLE_SLOT and slot["is_processing"] is False
        return
    assert set(slot) == SLOT and set(slot["params"]) == PARAMS
    assert isinstance(slot["next_token"], list) and set(slot["next_token"][0]) == NEXT_TOKEN  # a list, as sent


def test_slots_after_a_request(server: str, client: Any, ref: Reference) -> None:
    """A finished request's slot: its task, the tokens its cache holds, and its parameters (the request's, the
    command line's for what it leaves out); idle, it keeps none of the finished task's counts (next_token, the prompt
    counts), as llama-server resets them."""
    status, before = _slots(server)
    assert status == 200 and [s["id"] for s in before] == [0, 1]
    for i, slot in enumerate(before):
        _check_slot_shape(slot, i)
    messages = [{"role": "user", "content": "Count to three."}]
    rendered = ref.render(messages, thinking=False)
    resp = _chat(client, messages[0]["content"], 6, mode="ar", seed=11)
    usage = resp.usage
    assert usage.prompt_tokens == len(ref.ids(rendered)) and usage.completion_tokens == 6

    def finished() -> list[dict[str, Any]]:
        return [s for s in _slots(server)[1] if "id_task" in s and not s["is_processing"]
                and s["id_task"] not in {b.get("id_task") for b in before}]

    slot = _until(finished, bool, "the request's slot")[0]
    _check_slot_shape(slot, slot["id"])
    # the prompt and the answer but its last token, which no pass has decoded
    assert slot["n_prompt_tokens"] == usage.prompt_tokens + usage.completion_tokens - 1
    assert slot["n_prompt_tokens_processed"] == slot["n_prompt_tokens_cache"] == 0
    assert slot["next_token"] == [{"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}]
    params = slot["params"]
    assert (params["n_predict"], params["max_tokens"], params["seed"], params["temperature"]) == (6, 6, 11, 0.0)
    assert (params["top_k"], params["mode"], params["block_size"], params["threshold"]) == (5, "ar", 16, 0.5)
    assert params["top_p"] == pytest.approx(0.9) and params["stream"] is False
    assert params["speculative.types"].endswith("ngram-mod,draft-clover")  # the launcher's --spec-type
    assert rendered.endswith(params["generation_prompt"]) and params["generation_prompt"].startswith(
        "<|im_start|>assistant\n<think>")  # the template's, thinking off


def test_slots_while_both_decode(server: str, client: Any) -> None:
    """Two long streams at once: both slots processing, each with its own task, its tokens decoded so far and
    the budget left; ``?fail_on_no_slot=1`` is llama-server's 503 then, and a 200 once the streams are closed."""
    streams = [client.chat.completions.create(model=MODEL_ID, stream=True, max_tokens=1500, temperature=0,
                                              messages=[{"role": "user", "content": f"Story {i}."}], extra_body=LONG)
               for i in range(2)]
    try:
        busy = _until(lambda: _slots(server)[1], lambda s: all(x["is_processing"] and
                                                               x["next_token"][0]["n_decoded"] > 0 for x in s),
                      "both slots decoding")
        for i, slot in enumerate(busy):
            _check_slot_shape(slot, i)
            token = slot["next_token"][0]
            assert token["has_next_token"] is True and token["n_remain"] == 1500 - token["n_decoded"]
            params = slot["params"]
            assert (params["n_predict"], params["ignore_eos"], params["stream"]) == (1500, True, True)
            assert (params["mode"], params["block_size"], params["threshold"]) == ("diffusion", 16, 1.0)
        assert busy[0]["id_task"] != busy[1]["id_task"]
        status, err = _slots(server, "?fail_on_no_slot=1")
        assert (status, err) == (503, {"error": {"code": 503, "message": "no slot available",
                                                 "type": "unavailable_error"}})
    finally:
        for stream in streams:
            stream.close()
    status, idle = _until(lambda: _slots(server, "?fail_on_no_slot=1"),
                          lambda r: r[0] == 200 and not any(s["is_processing"] for s in r[1]), "the streams stopping")
    assert [s["next_token"][0]["n_decoded"] for s in idle] == [0, 0]


# ------------------------------------------------------------------------------------------ /metrics
def _scrape(url: str) -> tuple[dict[str, float], dict[str, tuple[str, str]], dict[str, str]]:
    """(samples by name, a label kept as name{label="v"}; (TYPE, HELP) by name; the answer's headers)."""
    status, headers, body = http(url + "/metrics")
    text = body.decode()
    assert status == 200, text
    samples: dict[str, float] = {}
    kinds: dict[str, str] = {}
    helps: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, help_text = line[7:].split(" ", 1)
            helps[name] = help_text
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            kinds[name] = kind
        else:
            name, value = line.rsplit(" ", 1)
            assert name.split("{")[0] in kinds, f"{name} has no # TYPE line"
            samples[name] = float(value)
    return samples, {n: (kinds[n], helps[n]) for n in kinds}, headers


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after["llamacpp:" + name] - before["llamacpp:" + name]


def _counted(server: str, before: dict[str, float], **rises: float) -> dict[str, float]:
    """The first scrape whose counters have risen by ``rises`` at least (llama-server counts a prompt's tokens once
    a decode has output, or its slots are idle: at times after the answer has gone out)."""
    return _until(lambda: _scrape(server)[0], lambda m: all(_delta(m, before, k) >= v for k, v in rises.items()),
                  f"the counters rising by {rises}")


def test_metrics_format_as_llama_server(server: str) -> None:
    """to_metrics' names, TYPE and HELP lines, llama-server's content type; the per-position counter of accepted
    drafts, once there, labelled by position."""
    samples, families, headers = _scrape(server)
    assert headers["content-type"] == "text/plain; version=0.0.4"
    assert re.fullmatch(r"\d+", headers["process-start-time-unix"])
    assert set(families) - {PER_POSITION} == set(METRICS)
    for name, (kind, help_text) in METRICS.items():
        assert families[name] == (kind, help_text), name
        assert samples[name] >= 0, name
    labelled = {k for k in samples if "{" in k}
    assert all(re.fullmatch(PER_POSITION + r'\{position="\d+"\}', k) for k in labelled), labelled
    assert (PER_POSITION in families) == bool(labelled)


def test_metrics_process_start_time_is_unix_time(server: str) -> None:
    """Seconds since 1970 (patch server-process-start-time-is-unix-time; it was ggml_time_us() at the start,
    microseconds of a monotonic clock)."""
    start = int(_scrape(server)[2]["process-start-time-unix"])
    assert 0 <= time.time() - start < 3600, start


def test_metrics_count_each_request(server: str, client: Any) -> None:
    """A request adds exactly its usage and timings: prompt tokens (prefilled and cached), generated tokens, drafts,
    causal and block passes, so the TPF gauge is the counters'; a repeated prompt is reused from the cache; a
    streamed answer is counted too; the throughput gauges cover the time since the last scrape."""
    prompt = "Write a loop that counts to five."
    before = _scrape(server)[0]
    resp = _chat(client, prompt, 12, mode="spec")
    u, t = resp.usage, resp.model_extra["timings"]
    cached = u.prompt_tokens_details.cached_tokens
    after = _counted(server, before, tokens_predicted_total=u.completion_tokens,
                     prompt_tokens_total=u.prompt_tokens - cached, prompt_tokens_cached_total=cached)
    assert _delta(after, before, "tokens_predicted_total") == u.completion_tokens == t["predicted_n"] == 12
    assert _delta(after, before, "prompt_tokens_total") == t["prompt_n"] == u.prompt_tokens - cached
    assert _delta(after, before, "prompt_tokens_cached_total") == t["cache_n"] == cached
    assert (_delta(after, before, "gen_block_passes_total"), _delta(after, before, "gen_causal_passes_total")) == \
        (t["block_passes"], t["causal_passes"]) == (0, t["causal_passes"])
    assert t["tokens_per_pass"] == pytest.approx(u.completion_tokens / t["causal_passes"])
    assert _delta(after, before, "spec_decode_num_draft_tokens_total") == t.get("draft_n", 0)
    assert _delta(after, before, "spec_decode_num_accepted_tokens_total") == t.get("draft_n_accepted", 0)
    assert _delta(after, before, "n_decode_total") >= t["causal_passes"]
    assert _delta(after, before, "tokens_predicted_seconds_total") > 0
    passes = after["llamacpp:gen_causal_passes_total"] + after["llamacpp:gen_block_passes_total"]
    assert after["llamacpp:gen_tokens_per_pass"] == pytest.approx(
        after["llamacpp:tokens_predicted_total"] / passes, rel=1e-5)
    assert after["llamacpp:predicted_tokens_seconds"] > 0 and after["llamacpp:prompt_tokens_seconds"] > 0
    again = _scrape(server)[0]
    assert again["llamacpp:predicted_tokens_seconds"] == again["llamacpp:prompt_tokens_seconds"] == 0
    assert again["llamacpp:requests_processing"] == again["llamacpp:requests_deferred"] == 0
    assert again["llamacpp:n_tokens_max"] >= u.prompt_tokens + u.completion_tokens - 1

    # the same prompt in diffusion: reused from the slot's cache, its blocks counted as block passes
    repeat = _chat(client, prompt, 12, mode="diffusion", block_size=4)
    u, t = repeat.usage, repeat.model_extra["timings"]
    reused = u.prompt_tokens_details.cached_tokens
    hit = _counted(server, again, tokens_predicted_total=u.completion_tokens, prompt_tokens_total=t["prompt_n"],
                   prompt_tokens_cached_total=reused)
    assert reused > 0 and _delta(hit, again, "prompt_tokens_cached_total") == t["cache_n"] == reused
    # a diffusion slot keeps the prompt's last token as its first block's pending token (docs/serve.md)
    assert _delta(hit, again, "prompt_tokens_total") == t["prompt_n"] == u.prompt_tokens - reused - 1
    assert (_delta(hit, again, "gen_block_passes_total"), _delta(hit, again, "gen_causal_passes_total")) == \
        (t["block_passes"], t["causal_passes"]) and t["block_passes"] > 0
    assert _delta(hit, again, "tokens_predicted_total") == u.completion_tokens

    chunks = list(client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"mode": "ar", **THINK_OFF}))
    n_streamed = chunks[-1].usage.completion_tokens
    streamed = _counted(server, hit, tokens_predicted_total=n_streamed)
    assert _delta(streamed, hit, "tokens_predicted_total") == n_streamed == 8


# ------------------------------------------------------------------------------------------ switched off
def test_switched_off_and_the_api_key(bare: str) -> None:
    """llama-server's answers without --slots/--metrics/--props (format_error_response's ERROR_TYPE_NOT_SUPPORTED:
    501, ``not_supported_error``, its messages); like every path but /health, these need the API key, and without it
    are llama-server's 401. /props gives llama-server's defaults: 4 slots (-np auto) of the model's trained context
    (-c 0: 4096 positions, each slot all of it, the KV cache unified)."""
    key = auth(KEY)
    refused = {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}
    for method, path, message in (
            ("GET", "/slots", "This server does not support slots endpoint. Start it with `--slots`"),
            ("GET", "/metrics", "This server does not support metrics endpoint. Start it with `--metrics`"),
            ("POST", "/props", "This server does not support changing global properties. Start it with `--props`")):
        body = b"{}" if method == "POST" else None
        status, _, raw = http(bare + path, body, key, method)
        assert (status, json.loads(raw)) == (501, {"error": {"code": 501, "message": message,
                                                             "type": "not_supported_error"}}), (path, raw)
        status, _, raw = http(bare + path, body, method=method)
        assert (status, json.loads(raw)) == (401, refused), (path, raw)
    status, _, raw = http(bare + "/props")
    assert (status, json.loads(raw)) == (401, refused)
    assert get(bare + "/health") == {"status": "ok"}
    status, _, raw = http(bare + "/props", headers=key)
    props = json.loads(raw)
    assert status == 200 and props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 4096
    assert (props["endpoint_slots"], props["endpoint_metrics"], props["endpoint_props"]) == (False, False, False)
    params = props["default_generation_settings"]["params"]
    # a random seed, no limit, llama.cpp's top-k (the GGUF sets none)
    assert (params["seed"], params["n_predict"], params["top_k"]) == (0xFFFFFFFF, -1, 40)
