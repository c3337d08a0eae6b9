"""`clover-cpp serve`'s llama-server monitoring endpoints (docs/serve.md, "Monitoring"): ``GET /props``, ``POST
/props``, ``GET /slots`` and ``GET /metrics``, on a live server over the tiny GGUF (never a mocked engine).

Each answer is checked key by key against llama-server's documented example (tools/server/README.md of the pinned
llama.cpp) and what its tools/server/server-context.cpp and server-task.cpp send, and its values against the
truth: the command line, the checkpoint's files, and the usage of the requests just made. A second server without
the switches (--no-slots, no --metrics, no --props) and with an API key gives llama-server's 501s and 401s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.chat import Reference
from tests.support.serve import MODEL_ID, THINK_OFF, auth, get, http, post_raw, serve

pytestmark = pytest.mark.native  # live servers (skipped without the build; a failure in CI)

KEY = "monitor-key"
# the main server: two slots of 2048 positions, the sampling defaults a request takes, B = 16 (calibrated: 0.95)
SERVER_ARGS = ("-np", "2", "-c", "4096", "--max-block-size", "32", "--block-size", "16", "--top-k", "5",
               "--top-p", "0.9", "-s", "7", "-n", "48", "--metrics", "--props")
LONG = {"mode": "diffusion", "block_size": 16, "threshold": 1.0, "ignore_eos": True, **THINK_OFF}  # ~1 token/pass

# README "GET /props", "Response format"
README_PROPS = {"default_generation_settings", "total_slots", "model_path", "chat_template", "chat_template_caps",
                "modalities", "media_marker", "build_info", "is_sleeping"}
README_DEFAULT_SETTINGS = {"id", "id_task", "n_ctx", "speculative", "is_processing", "params", "prompt", "next_token"}
README_PROPS_PARAMS = {
    "n_predict", "seed", "temperature", "dynatemp_range", "dynatemp_exponent", "top_k", "top_p", "min_p",
    "xtc_probability", "xtc_threshold", "typical_p", "repeat_last_n", "repeat_penalty", "presence_penalty",
    "frequency_penalty", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
    "dry_sequence_breakers", "mirostat", "mirostat_tau", "mirostat_eta", "stop", "max_tokens", "n_keep", "n_discard",
    "ignore_eos", "stream", "n_probs", "min_keep", "grammar", "samplers", "speculative.n_max", "speculative.n_min",
    "speculative.p_min", "timings_per_token"}
# server-context.cpp's get_res_props, beyond the README's
CODE_PROPS = {"model_alias", "model_ftype", "endpoint_slots", "endpoint_props", "endpoint_metrics", "ui",
              "ui_settings", "bos_token", "eos_token", "cors_proxy_enabled"}
# server-task.cpp's task_params::to_json(false), beyond the README's
CODE_PROPS_PARAMS = {"top_n_sigma", "adaptive_target", "adaptive_decay", "logit_bias", "grammar_lazy",
                     "grammar_triggers", "preserved_tokens", "chat_format", "reasoning_format", "reasoning_in_content",
                     "generation_prompt", "speculative.types", "post_sampling_probs", "backend_sampling", "lora"}
# README "GET /slots", "Example with 2 slots"
README_SLOT = {"id", "id_task", "n_ctx", "speculative", "is_processing", "params", "next_token"}
README_SLOT_PARAMS = (README_PROPS_PARAMS - {"dry_sequence_breakers", "stop", "grammar"}) | {
    "top_n_sigma", "chat_format", "reasoning_format", "reasoning_in_content", "generation_prompt",
    "post_sampling_probs", "lora"}
CODE_SLOT = {"n_prompt_tokens", "n_prompt_tokens_processed", "n_prompt_tokens_cache"}  # server_slot::to_json
CODE_SLOT_PARAMS = {"adaptive_target", "adaptive_decay", "speculative.types", "backend_sampling"}
NEXT_TOKEN = {"has_next_token", "has_new_line", "n_remain", "n_decoded"}
# server-task.cpp's server_task_result_metrics::to_metrics: name -> (TYPE, HELP); README "GET /metrics" lists them
LLAMA_METRICS = {
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
    "llamacpp:prompt_tokens_seconds": ("gauge", "Average prompt throughput in tokens/s"),
    "llamacpp:predicted_tokens_seconds": ("gauge", "Average generation throughput in tokens/s"),
    "llamacpp:requests_processing": ("gauge", "Number of requests processing"),
    "llamacpp:requests_deferred": ("gauge", "Number of requests deferred"),
    "llamacpp:n_busy_slots_per_decode": ("gauge", "Average number of busy slots per llama_decode() call"),
}
CLOVER_BY_MODE = ("clover:requests_total", "clover:generated_tokens_total", "clover:block_passes_total",
                  "clover:causal_passes_total", "clover:tokens_per_pass")


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[str]:
    with serve(tiny_gguf, tiny_gguf.parent, *SERVER_ARGS) as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def bare(tiny_gguf: Path) -> Iterator[str]:
    """The switches left off, and an API key."""
    with serve(tiny_gguf, tiny_gguf.parent, "--no-slots", "--api-key", KEY) as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client: Any, content: str, max_tokens: int, **extra: Any) -> Any:
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": content}],
                                          max_tokens=max_tokens, temperature=0, extra_body={**THINK_OFF, **extra})


def _until(probe: Any, ok: Any, what: str, timeout: float = 30) -> Any:
    """Call ``probe`` until ``ok(result)``: the worker counts a job just after its answer has gone out."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if ok(got):
            return got
        assert time.monotonic() < deadline, f"{what}: {got}"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------ /props
def test_props_as_llama_server(server: str, tiny_gguf: Path, ref: Reference) -> None:
    """README "GET /props": the documented fields and those server-context.cpp's get_res_props adds, with the
    values of this server's command line and model; and ``clover``, the settings a request decodes with."""
    props = get(server + "/props")
    assert README_PROPS | CODE_PROPS | {"clover"} == set(props)
    assert props["total_slots"] == 2 and props["model_alias"] == MODEL_ID
    assert props["model_path"] == str(tiny_gguf) and props["model_ftype"] == "all F32"
    assert props["chat_template"] == ref.template and props["chat_template_caps"] == {}
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}
    assert isinstance(props["media_marker"], str) and isinstance(props["build_info"], str) and props["build_info"]
    assert props["is_sleeping"] is False and props["cors_proxy_enabled"] is False and props["ui_settings"] == {}
    assert (props["endpoint_slots"], props["endpoint_metrics"], props["endpoint_props"]) == (True, True, True)
    assert props["ui"] == (http(server + "/")[0] == 200)
    assert props["eos_token"] == ref.tokenizer.id_to_token(3002)  # config.json's first eos id, the GGUF's eos
    assert isinstance(props["bos_token"], str)  # none in the GGUF: llama.cpp's default for its vocabulary type

    settings = props["default_generation_settings"]
    assert set(settings) == README_DEFAULT_SETTINGS
    assert settings["n_ctx"] == 2048 and settings["id"] == 0 and settings["id_task"] == -1  # -c / -np
    assert settings["is_processing"] is False and settings["speculative"] is True  # the default mode, auto, drafts
    assert set(settings["next_token"]) == NEXT_TOKEN | {"stopping_word"}
    params = settings["params"]
    assert README_PROPS_PARAMS | CODE_PROPS_PARAMS == set(params)
    assert (params["seed"], params["top_k"], params["top_p"], params["temperature"]) == (7, 5, 0.9, 0.0)
    assert params["n_predict"] == params["max_tokens"] == 48 and params["ignore_eos"] is False
    assert params["samplers"] == ["temperature", "top_k", "top_p"] and params["stop"] == []
    assert params["speculative.n_max"] == 16

    clover = props["clover"]
    assert (clover["mode"], clover["block_size"], clover["max_block_size"]) == ("auto", 16, 32)
    assert clover["threshold"] == pytest.approx(0.95)  # calibrated for B = 16 (config.json)
    assert (clover["n_parallel"], clover["n_ctx"], clover["enable_thinking"]) == (2, 2048, True)
    gguf = clover["gguf"]
    assert (gguf["block_size"], gguf["mask_token_id"], gguf["has_block_diffusion"]) == (8, 3007, True)
    assert gguf["calibrated_block_sizes"] == [4, 8, 16]
    assert gguf["calibrated_thresholds"] == pytest.approx([0.9, 0.9, 0.95])
    assert gguf["threshold"] == pytest.approx(0.9) and 0 < gguf["coreset_top_p"] <= 1 and gguf["history_rows"] > 0

    got, body = post_raw(server + "/props", b"{}")  # --props: accepted, though nothing can be changed yet
    assert (got, body) == (200, {"success": True})


# ------------------------------------------------------------------------------------------ /slots
def _slots(url: str, query: str = "") -> tuple[int, Any]:
    status, _, body = http(url + "/slots" + query)
    return status, json.loads(body)


def _check_slot_shape(slot: dict[str, Any], i: int) -> None:
    """README "GET /slots": a slot that never ran a job has only its own fields (as server_slot::to_json)."""
    assert slot["id"] == i and slot["n_ctx"] == 2048
    if "id_task" not in slot:
        assert set(slot) == {"id", "n_ctx", "speculative", "is_processing"} and slot["is_processing"] is False
        return
    assert set(slot) == README_SLOT | CODE_SLOT | {"clover"}
    assert set(slot["params"]) == README_SLOT_PARAMS | CODE_SLOT_PARAMS
    assert isinstance(slot["next_token"], list) and set(slot["next_token"][0]) == NEXT_TOKEN  # a list, as sent


def test_slots_after_a_request(server: str, client: Any) -> None:
    """A finished request's slot: its task, prompt and cache counts, parameters and stats; idle, it keeps none of
    the finished task's budget (next_token), as llama-server's."""
    status, before = _slots(server)
    assert status == 200 and [s["id"] for s in before] == [0, 1]
    for i, slot in enumerate(before):
        _check_slot_shape(slot, i)
    resp = _chat(client, "Count to three.", 6, mode="ar", seed=11)
    usage = resp.usage

    def finished() -> list[dict[str, Any]]:
        return [s for s in _slots(server)[1] if s.get("n_prompt_tokens") == usage.prompt_tokens
                and s["clover"]["stats"] is not None and s["id_task"] not in {b.get("id_task") for b in before}]

    slot = _until(finished, bool, "the request's slot")[0]
    _check_slot_shape(slot, slot["id"])
    assert slot["is_processing"] is False
    assert slot["n_prompt_tokens_cache"] == usage.prompt_tokens_details.cached_tokens
    assert slot["n_prompt_tokens_processed"] == usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
    assert slot["next_token"] == [{"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}]
    params = slot["params"]
    assert (params["n_predict"], params["seed"], params["temperature"], params["top_k"]) == (6, 11, 0.0, 5)
    assert slot["speculative"] is False and params["speculative.types"] == "none"
    stats = slot["clover"]["stats"]
    assert slot["clover"]["mode"] == stats["mode"] == "ar"
    assert stats["generated_tokens"] == usage.completion_tokens


def test_slots_while_both_decode(server: str, client: Any) -> None:
    """Two long streams at once: both slots processing, each with its own task, its tokens decoded so far and
    the budget left; ``?fail_on_no_slot=1`` is llama-server's 503 then, and a 200 once a slot is free."""
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
            assert slot["params"]["n_predict"] == 1500 and slot["params"]["ignore_eos"] is True
            assert slot["clover"] == {"mode": "diffusion", "block_size": 16, "threshold": 1.0, "stats": None}
        assert busy[0]["id_task"] != busy[1]["id_task"]
        status, err = _slots(server, "?fail_on_no_slot=1")
        assert status == 503 and err == {"error": {"message": "no slot available", "type": "unavailable_error",
                                                   "param": None, "code": 503}}
    finally:
        for stream in streams:
            stream.close()
    _until(lambda: get(server + "/health"), lambda h: h["running"] == h["waiting"] == 0, "the streams stopping")
    status, idle = _slots(server, "?fail_on_no_slot=1")
    assert status == 200 and not any(s["is_processing"] for s in idle)


# ------------------------------------------------------------------------------------------ /metrics
def _scrape(url: str) -> tuple[dict[str, float], dict[str, tuple[str, str]], dict[str, str]]:
    """(samples by name, with a mode label as name{mode="m"}; (TYPE, HELP) by name; the answer's headers)."""
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


def _delta(after: dict[str, float], before: dict[str, float], name: str, mode: str | None = None) -> float:
    key = f'{name}{{mode="{mode}"}}' if mode else name
    return after[key] - before[key]


def _metrics_after(server: str, before: dict[str, float], mode: str) -> dict[str, float]:
    """The first scrape that counts one more request of ``mode``."""
    key = f'clover:requests_total{{mode="{mode}"}}'
    return _until(lambda: _scrape(server)[0], lambda m: m[key] == before[key] + 1, f"{key} rising")


def test_metrics_format_as_llama_server(server: str) -> None:
    """README "GET /metrics": llama-server's names, with the TYPE and HELP lines of server-task.cpp, its
    Process-Start-Time-Unix header and content type; clover's own, one sample per mode."""
    samples, families, headers = _scrape(server)
    assert headers["content-type"] == "text/plain; version=0.0.4"
    assert abs(int(headers["process-start-time-unix"]) - time.time()) < 3600
    for name, (kind, help_text) in LLAMA_METRICS.items():
        assert families[name] == (kind, help_text), name
        assert samples[name] >= 0
    for name in CLOVER_BY_MODE:
        assert families[name][0] == ("gauge" if name == "clover:tokens_per_pass" else "counter")
        assert {k for k in samples if k.startswith(name + "{")} == {
            f'{name}{{mode="{m}"}}' for m in ("ar", "diffusion", "spec", "auto")}
    assert families["clover:prefix_cache_hits_total"][0] == "counter"


def test_metrics_count_each_request(server: str, client: Any) -> None:
    """A request adds exactly its usage: prompt tokens (prefilled and cached), generated tokens, its block and
    causal passes, so the counters' TPF is the request's; a repeated prompt is a prefix-cache hit; a streamed
    answer is counted too; the throughput gauges cover the time since the last scrape."""
    before = _scrape(server)[0]
    resp = _chat(client, "Write a loop that counts to five.", 12, mode="spec", block_size=4)
    after = _metrics_after(server, before, "spec")
    u, c = resp.usage, resp.usage.model_extra["clover"]
    cached = u.prompt_tokens_details.cached_tokens
    assert _delta(after, before, "llamacpp:tokens_predicted_total") == u.completion_tokens > 0
    assert _delta(after, before, "llamacpp:prompt_tokens_total") == u.prompt_tokens - cached
    assert _delta(after, before, "llamacpp:prompt_tokens_cached_total") == cached
    assert _delta(after, before, "clover:generated_tokens_total", "spec") == u.completion_tokens
    passes = (_delta(after, before, "clover:block_passes_total", "spec"),
              _delta(after, before, "clover:causal_passes_total", "spec"))
    assert passes == (c["block_passes"], c["causal_passes"])
    assert u.completion_tokens / sum(passes) == pytest.approx(c["tokens_per_pass"])
    spec_passes = after['clover:block_passes_total{mode="spec"}'] + after['clover:causal_passes_total{mode="spec"}']
    assert after['clover:tokens_per_pass{mode="spec"}'] == pytest.approx(
        after['clover:generated_tokens_total{mode="spec"}'] / spec_passes)
    assert _delta(after, before, "llamacpp:n_decode_total") >= sum(passes)
    assert _delta(after, before, "llamacpp:tokens_predicted_seconds_total") > 0
    assert after["llamacpp:predicted_tokens_seconds"] > 0 and after["llamacpp:prompt_tokens_seconds"] > 0
    again = _scrape(server)[0]
    assert again["llamacpp:predicted_tokens_seconds"] == again["llamacpp:prompt_tokens_seconds"] == 0
    assert again["llamacpp:requests_processing"] == again["llamacpp:requests_deferred"] == 0
    assert again["llamacpp:n_tokens_max"] >= u.prompt_tokens + u.completion_tokens

    repeat = _chat(client, "Write a loop that counts to five.", 12, mode="spec", block_size=4)
    hit = _metrics_after(server, again, "spec")
    reused = repeat.usage.prompt_tokens_details.cached_tokens
    assert reused > 0 and _delta(hit, again, "clover:prefix_cache_hits_total") == 1
    assert _delta(hit, again, "llamacpp:prompt_tokens_cached_total") == reused

    chunks = list(client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"mode": "ar", **THINK_OFF}))
    streamed = _metrics_after(server, hit, "ar")
    assert _delta(streamed, hit, "llamacpp:tokens_predicted_total") == chunks[-1].usage.completion_tokens


# ------------------------------------------------------------------------------------------ switched off
def test_switched_off_and_the_api_key(bare: str) -> None:
    """llama-server's answers without --slots/--metrics/--props (format_error_response's ERROR_TYPE_NOT_SUPPORTED:
    501, ``not_supported_error``, its messages); like every path but /health, these need the API key."""
    key = auth(KEY)
    for method, path, message in (
            ("GET", "/slots", "This server does not support slots endpoint. Start it with `--slots`"),
            ("GET", "/metrics", "This server does not support metrics endpoint. Start it with `--metrics`"),
            ("POST", "/props", "This server does not support changing global properties. Start it with `--props`")):
        body = b"{}" if method == "POST" else None
        status, _, raw = http(bare + path, body, key, method)
        assert status == 501 and json.loads(raw) == {"error": {"message": message, "type": "not_supported_error",
                                                               "param": None, "code": 501}}, (path, raw)
        status, _, raw = http(bare + path, body, method=method)
        assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key", (path, raw)
    assert http(bare + "/props")[0] == 401
    status, _, raw = http(bare + "/props", headers=key)
    props = json.loads(raw)
    assert status == 200 and props["total_slots"] == 1 and props["default_generation_settings"]["n_ctx"] == 4096
    assert (props["endpoint_slots"], props["endpoint_metrics"], props["endpoint_props"]) == (False, False, False)
    params = props["default_generation_settings"]["params"]
    assert (params["seed"], params["n_predict"], params["top_k"]) == (0xFFFFFFFF, -1, 0)  # random seed, no limit
