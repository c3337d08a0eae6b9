"""What the earlier server's tests checked, against `clover-cpp serve` (llama-server) on the demo model, through the
official `openai` client (docs/serve.md):

- a streamed chat answer is the answer not streamed, in every mode; the lossless modes (`auto`, `spec`) give `ar`'s;
- `json_schema` answers are valid JSON of the schema in every lossless mode, sampled or greedy;
- logprobs agree across `ar`, `auto` and `spec` (the same tokens; values within f32 rounding of a verification
  batch, or a near tie, tests/support/);
- `/tokenize` and `/detokenize` round-trip, `/props` and `/slots` describe the server, `/metrics` counts a
  request's tokens and passes (Clover's counters: causal and block passes, and TPF);
- an API key guards the API but not `/health`, with the OpenAI error body.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clover_dev.process import server_metrics
from tests.support.serve import auth, clover_serve, get, http, post

pytestmark = pytest.mark.native

MODEL = "demo"
LOSSLESS = ("ar", "auto", "spec")
THINK_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "Write a function that parses a line of a CSV file."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "count": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "count"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(demo_gguf: Path) -> Iterator[str]:
    with clover_serve(demo_gguf, "-c", "2048", "-np", "2", "-t", "2", "--no-warmup", "--alias", MODEL,
                      "--metrics") as (url, _, _):
        yield url


def _client(url: str, key: str = "none") -> Any:
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _chat(url: str, mode: str, stream: bool, **fields: Any) -> str:
    kwargs = {"model": MODEL, "messages": ASK, "max_tokens": 48, "temperature": 0.0,
              "extra_body": {"mode": mode, **THINK_OFF}, **fields}
    client = _client(url)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                   if c.choices)


@pytest.mark.parametrize("mode", [*LOSSLESS, "diffusion"])
def test_stream_equals_non_stream_and_lossless_modes_equal_ar(server: str, mode: str) -> None:
    answer = _chat(server, mode, False)
    assert answer and _chat(server, mode, True) == answer
    if mode in LOSSLESS:
        assert answer == _chat(server, "ar", False)


def _valid(text: str) -> dict[str, Any]:
    value = json.loads(text)
    assert set(value) == {"name", "count"} and isinstance(value["name"], str) and isinstance(value["count"], int) \
        and not isinstance(value["count"], bool), value
    return value


@pytest.mark.parametrize("mode", LOSSLESS)
def test_json_schema_is_valid_in_every_lossless_mode(server: str, mode: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    greedy = _chat(server, mode, False, response_format=fmt, max_tokens=96)
    assert _valid(greedy) == _valid(_chat(server, "ar", False, response_format=fmt, max_tokens=96))
    for seed in (1, 2, 3):
        _valid(_chat(server, mode, False, response_format=fmt, max_tokens=96, temperature=0.8, seed=seed))


def test_logprobs_agree_across_lossless_modes(demo_gguf: Path) -> None:
    """On a server whose drafter is the model's own block pass (draft-clover drafts every round, deterministically;
    an n-gram drafter drafts only where the history repeats), so that drafted tokens are checked."""
    runs = {}
    with clover_serve(demo_gguf, "-c", "1024", "-np", "1", "-t", "2", "--no-warmup", "--alias", MODEL,
                      "--spec-type", "draft-clover") as (url, _, _):
        for mode in LOSSLESS:
            resp = _client(url).chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=64, temperature=0.0, logprobs=True, top_logprobs=3,
                extra_body={"mode": mode, **THINK_OFF})
            runs[mode] = resp.choices[0].logprobs.content
            accepted = resp.model_extra["timings"].get("draft_n_accepted", 0)
            assert (accepted > 0) == (mode != "ar"), (mode, resp.model_extra["timings"])
    for mode in ("auto", "spec"):
        assert [t.token for t in runs[mode]] == [t.token for t in runs["ar"]], mode
        for ours, ar in zip(runs[mode], runs["ar"]):
            # f32 logits of one position differ by rounding between a 1-token pass and a verification batch
            assert ours.logprob == pytest.approx(ar.logprob, abs=1e-3), (mode, ours, ar)
            assert [t.token for t in ours.top_logprobs][:1] == [t.token for t in ar.top_logprobs][:1]


def test_tokenize_props_slots_metrics(server: str) -> None:
    text = "def add(a, b):\n    return a + b  # \U0001d518 sum"
    status, tokens = post(server + "/tokenize", {"content": text, "with_pieces": True})
    assert status == 200 and all("piece" in t for t in tokens["tokens"])
    status, back = post(server + "/detokenize", {"tokens": [t["id"] for t in tokens["tokens"]]})
    assert status == 200 and back["content"] == text
    props = get(server + "/props")
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 1024
    assert "<|im_start|>" in props["chat_template"]
    slots = get(server + "/slots")
    assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == 1024 for s in slots)

    for mode in ("ar", "diffusion"):
        before = server_metrics(server)
        resp = _client(server).chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0.0,
                                                       extra_body={"mode": mode, **THINK_OFF})
        after, timings = server_metrics(server), resp.model_extra["timings"]
        assert after["tokens_predicted_total"] - before["tokens_predicted_total"] == resp.usage.completion_tokens
        assert after["gen_block_passes_total"] - before["gen_block_passes_total"] == timings["block_passes"]
        assert after["gen_causal_passes_total"] - before["gen_causal_passes_total"] == timings["causal_passes"]
        assert (timings["block_passes"] > 0) == (mode == "diffusion"), timings
    passes = after["gen_block_passes_total"] + after["gen_causal_passes_total"]
    assert after["gen_tokens_per_pass"] == pytest.approx(after["tokens_predicted_total"] / passes, rel=1e-5)


def test_an_api_key_guards_the_api_but_not_health(demo_gguf: Path) -> None:
    import openai

    with clover_serve(demo_gguf, "-c", "512", "-np", "1", "--no-warmup", "--api-key", "sesame") as (url, _, _):
        assert get(url + "/health")["status"] == "ok"
        status, _, body = http(url + "/v1/models")
        assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error", body
        status, _, _ = http(url + "/v1/models", headers=auth("sesame"))
        assert status == 200
        with pytest.raises(openai.AuthenticationError):
            _client(url, "wrong").models.list()
        assert _client(url, "sesame").models.list().data


def test_the_next_turn_reuses_the_prompt_up_to_its_generation_prompt(server: str) -> None:
    """The demo model's memory is recurrent: a turn resumes from a context checkpoint. The server takes one where
    the generation prompt starts (patch server-checkpoint-at-generation-prompt), so the second turn reuses the first
    turn's prompt but for its generation prompt, its user message included; the checkpoint before that message
    (all there was before the patch) leaves the message to prefill again."""
    user = "Explain, step by step and with an example for each step, how a hash map resolves a collision. " * 3
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": user}]
    client = _client(server)
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.0,
                                           extra_body={"mode": "ar", **THINK_OFF})
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Shorter."}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.0,
                                            extra_body={"mode": "ar", **THINK_OFF})
    status, user_tokens = post(server + "/tokenize", {"content": user})
    assert status == 200
    reused = second.usage.prompt_tokens_details.cached_tokens
    n_first = first.usage.prompt_tokens
    # the generation prompt of this template with thinking off: "<|im_start|>assistant\n" and an empty think block
    assert n_first - 12 <= reused < n_first, (reused, n_first)
    assert reused > n_first - len(user_tokens["tokens"]), "the first turn's user message was prefilled again"
