"""OpenAI requests to engine work: rendered prompt ids, GenParams, and the text pipeline settings.

Everything here runs before a job is queued, so a bad request is answered with a 400 and never reaches
the engine.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass
from typing import Any

from ..chat_template import ChatTemplate, TemplateError
from ..model import Model
from .schema import (APIError, ApplyTemplateRequest, ChatCompletionRequest, ChatMessage, CloverFields,
                     CompletionRequest, invalid)
from ..output_parser import opens_reasoning
from ..gen_params import GenParams
from .constraints import Constraint, grammar_after_ids, request_constraint

MAX_STOP_STRINGS = 4


@dataclass(frozen=True)
class Defaults:
    """Server-wide defaults for what a request leaves out: the generation parameters of the command line, and
    llama-server's -n and -s/--seed, where None means what the context leaves and a random seed per request."""

    gen: GenParams = GenParams()
    enable_thinking: bool = True
    max_tokens: int | None = None
    seed: int | None = None


@dataclass(frozen=True)
class Prepared:
    prompt_ids: list[int]
    params: GenParams
    stops: list[str]
    start_in_reasoning: bool = False
    parse_tools: bool = False
    echo_text: str = ""
    checkpoint_hint: int = 0  # where the generation prompt starts: the next turn's prompt shares what lies before
    cache_prompt: bool = True  # reuse the slot's history prefix (llama-server's request field of that name)
    n: int = 1  # answers to the same prompt, each on its own slot (seeds seed, seed + 1, ...)


def answers(prep: Prepared) -> list[Prepared]:
    """The n answers a request asks for: answer i samples with seed + i (llama-server's n, one slot each)."""
    seeds = [(prep.params.seed + i) & 0xFFFFFFFF for i in range(prep.n)]
    return [prep] + [dataclasses.replace(prep, params=prep.params.replace(seed=s)) for s in seeds[1:]]


@dataclass(frozen=True)
class Rendered:
    """A conversation through the chat template: the text, and what it was rendered from."""

    text: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    thinking: bool


class Preparer:
    def __init__(self, model: Model, template: ChatTemplate | None, model_id: str, max_block_size: int,
                 defaults: Defaults, max_messages: int = 0, max_prompt_chars: int = 0) -> None:
        """``max_messages`` / ``max_prompt_chars`` (0 = no limit): --max-messages and --max-prompt-chars."""
        self.model = model
        self.max_messages = max_messages
        self.max_prompt_chars = max_prompt_chars
        self.template = template
        self.model_id = model_id
        self.max_block_size = max_block_size
        self.defaults = defaults
        self.n_ctx = model.n_ctx

    # ------------------------------------------------------------------------------ shared
    def check_model(self, name: str) -> None:
        if name != self.model_id:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_id}`.",
                           param="model", code="model_not_found")

    def _stops(self, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise invalid(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
        return [s for s in stops if s]

    def _bias(self, logit_bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's logit_bias: token id (a string key) -> bias in [-100, 100], added to the logit (spec 4);
        -100 bans the token, as OpenAI documents."""
        out: list[tuple[int, float]] = []
        n_vocab = self.model.info.n_vocab
        for key, bias in (logit_bias or {}).items():
            try:
                tok = int(key)
            except ValueError:
                raise invalid(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= tok < n_vocab:
                raise invalid(f"logit_bias token {tok} is outside the vocabulary (0..{n_vocab - 1})", "logit_bias")
            if not -100.0 <= bias <= 100.0:  # NaN fails too
                raise invalid(f"logit_bias of token {tok} must be in [-100, 100], got {bias}", "logit_bias")
            out.append((tok, float("-inf") if bias <= -100.0 else float(bias)))
        banned = {t for t, b in out if b == float("-inf")} | {self.model.info.mask_token_id}
        if len(banned) >= n_vocab:
            raise invalid("logit_bias bans every token of the vocabulary: nothing could be generated", "logit_bias")
        return tuple(out)

    def _n(self, req: CloverFields) -> int:
        """``n`` answers run at once, one per slot (llama-server's -np), so they never queue behind each other."""
        slots = self.model.n_parallel
        if req.n > slots:
            raise invalid(f"n = {req.n} needs {req.n} slots; this server has {slots} (start it with -np {req.n})",
                          "n", "unsupported_value")
        return req.n

    def _params(self, req: CloverFields, n_prompt: int, max_tokens: int | None, param: str,
                logprobs: int | None = None, constraint: Constraint | None = None,
                grammar_after: tuple[int, ...] = ()) -> GenParams:
        if req.stream_options is not None and not req.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        d = self.defaults
        block = req.block_size or d.gen.block_size
        if block is not None and block > self.max_block_size:
            raise invalid(f"block_size {block} exceeds the server's largest block size {self.max_block_size} "
                          f"(start it with --max-block-size)", "block_size")
        room = self.n_ctx - n_prompt
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {self.n_ctx} tokens. However, your "
                           f"{param} has {n_prompt} tokens, which leaves no room for a completion.",
                           param=param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = room if d.max_tokens is None else min(d.max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.n_ctx} tokens. However, you "
                           f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the {param}, {max_tokens} "
                           f"in the completion). Please reduce the {param} or the completion length.",
                           param="max_tokens", code="context_length_exceeded")
        temperature = d.gen.temperature if req.temperature is None else req.temperature
        seed = req.seed if req.seed is not None else d.seed
        if seed is None:
            seed = secrets.randbits(32) if temperature > 0 else 0
        return d.gen.replace(
            mode=req.mode or d.gen.mode, block_size=block,
            threshold=req.threshold if req.threshold is not None else d.gen.threshold,
            coreset_top_p=req.coreset_top_p if req.coreset_top_p is not None else d.gen.coreset_top_p,
            max_tokens=max_tokens, temperature=temperature, top_k=d.gen.top_k if req.top_k is None else req.top_k,
            top_p=d.gen.top_p if req.top_p is None else req.top_p, seed=seed,
            stop_ids=() if req.ignore_eos else None, logit_bias=self._bias(req.logit_bias),
            repeat_penalty=d.gen.repeat_penalty if req.repeat_penalty is None else req.repeat_penalty,
            presence_penalty=d.gen.presence_penalty if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=d.gen.frequency_penalty if req.frequency_penalty is None else req.frequency_penalty,
            grammar=constraint.grammar if constraint else None, grammar_after_ids=grammar_after if constraint else (),
            logprobs=logprobs)

    def check_chars(self, n_chars: int, param: str, what: str) -> None:
        """--max-prompt-chars, checked before tokenizing (a token holds a few characters: a prompt far beyond the
        context is refused without the tokenizer's work)."""
        if self.max_prompt_chars and n_chars > self.max_prompt_chars:
            raise APIError(400, f"The {what} has {n_chars} characters, more than the server's limit of "
                           f"{self.max_prompt_chars} (start the server with --max-prompt-chars to change it).",
                           param=param, code="context_length_exceeded")

    def _tokenize(self, text: str, param: str) -> list[int]:
        self.check_chars(len(text), param, "prompt" if param == "prompt" else "rendered conversation")
        ids = self.model.tokenize(text, special=True)
        if not ids:
            raise invalid(f"the {param} is empty after tokenization", param)
        return ids

    # ------------------------------------------------------------------------------ chat
    def _require_template(self) -> ChatTemplate:
        if self.template is None:
            raise invalid("this model has no chat template; use /v1/completions, or start the server with "
                          "--chat-template FILE", "messages", "no_chat_template")
        return self.template

    def render(self, req: ChatCompletionRequest | ApplyTemplateRequest) -> Rendered:
        """The conversation through the chat template: for a chat completion, and alone for /apply-template."""
        template = self._require_template()
        kwargs = req.chat_template_kwargs or {}
        thinking = kwargs.get("enable_thinking", self.defaults.enable_thinking)
        if not isinstance(thinking, bool):
            raise invalid("chat_template_kwargs.enable_thinking must be true or false",
                          "chat_template_kwargs.enable_thinking")
        if self.max_messages and len(req.messages) > self.max_messages:
            raise invalid(f"The request has {len(req.messages)} messages, more than the server's limit of "
                          f"{self.max_messages} (start the server with --max-messages to change it).", "messages",
                          "too_many_messages")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        messages = [template_message(m, i) for i, m in enumerate(req.messages)]
        self.check_chars(sum(len(m["content"]) + len(m.get("reasoning_content") or "") for m in messages),
                          "messages", "conversation")
        try:
            text = template.render(messages, tools=tools, enable_thinking=thinking)
        except TemplateError as exc:
            raise invalid(str(exc), "messages") from None
        return Rendered(text, messages, tools, thinking)

    def chat(self, req: ChatCompletionRequest) -> Prepared:
        check_unicode(req.model_dump(exclude_none=True))
        self.check_model(req.model)
        template = self._require_template()
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("top_logprobs needs logprobs = true", "top_logprobs")
        n = self._n(req)
        constraint = request_constraint(self.model, req)
        r = self.render(req)
        ids = self._tokenize(r.text, "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        reasoning = opens_reasoning(r.text)
        after = grammar_after_ids(self.model, reasoning) if constraint else ()
        params = self._params(req, len(ids), max_tokens, "messages", (req.top_logprobs or 0) if req.logprobs else None,
                              constraint, after)
        hint = template.generation_prompt_start(lambda t: self.model.tokenize(t, special=True), r.messages,
                                                r.tools, r.thinking, r.text, ids)
        return Prepared(ids, params, self._stops(req.stop), cache_prompt=req.cache_prompt,
                        start_in_reasoning=reasoning, parse_tools=bool(r.tools) and req.tool_choice != "none",
                        checkpoint_hint=hint, n=n)

    def apply_template(self, req: ApplyTemplateRequest) -> str:
        """llama-server's /apply-template: the prompt a chat completion of these messages would run on."""
        check_unicode(req.model_dump(exclude_none=True))
        return self.render(req).text

    # ------------------------------------------------------------------------------ completions
    def completion(self, req: CompletionRequest) -> Prepared:
        check_unicode(req.model_dump(exclude_none=True))
        self.check_model(req.model)
        if req.suffix:
            raise invalid("suffix is not supported", "suffix", "unsupported_value")
        n = self._n(req)
        constraint = request_constraint(self.model, req)
        if req.best_of not in (None, 1):
            raise invalid("only best_of = 1 is supported", "best_of", "unsupported_value")
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise invalid("batched prompts are not supported: send one prompt per request", "prompt",
                              "unsupported_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self._tokenize(prompt, "prompt")
            echo = prompt
        else:
            ids = [int(t) for t in prompt]
            if not ids:
                raise invalid("the prompt is empty", "prompt")
            bad = [t for t in ids if not 0 <= t < self.model.info.n_vocab]
            if bad:
                raise invalid(f"prompt token {bad[0]} is outside the vocabulary (0..{self.model.info.n_vocab - 1})",
                              "prompt")
            echo = self.model.detokenize(ids)
        params = self._params(req, len(ids), req.max_tokens, "prompt", req.logprobs, constraint)
        return Prepared(ids, params, self._stops(req.stop), echo_text=echo if req.echo else "",
                        cache_prompt=req.cache_prompt, n=n)


def check_unicode(value: Any, path: str = "") -> None:
    """Every string of the request must be valid Unicode: JSON can carry a lone surrogate (``"\\ud800"``), which
    no tokenizer (and no UTF-8 answer) can hold. A 400 naming the field, before anything else."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise invalid(f"'{path or 'body'}' holds a lone surrogate (\\u{ord(value[exc.start]):04x} at character "
                          f"{exc.start}): strings must be valid Unicode", path or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, path)
            check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_unicode(item, f"{path}.{i}" if path else str(i))


def _text(content: Any, index: int) -> str | None:
    """Message content as text: a string, or the text parts of a list joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise invalid(f"messages[{index}]: content part type {part.type!r} is not supported (text only)",
                          f"messages.{index}.content", "unsupported_value")
        texts.append(part.text)
    return "\n".join(texts)


def template_message(m: ChatMessage, index: int) -> dict[str, Any]:
    """An OpenAI message as the chat template reads it."""
    content = _text(m.content, index)
    if content is None and m.role != "assistant":
        raise invalid(f"messages[{index}]: a {m.role} message needs content", f"messages.{index}.content",
                      "missing_required_parameter")
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
    if m.name:
        out["name"] = m.name
    if m.role == "assistant":
        if m.reasoning_content is not None:
            out["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
    if m.role == "tool" and m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _arguments(args: str | dict[str, Any]) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
