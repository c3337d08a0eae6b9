"""`clover-cpp chat`: an interactive multi-turn chat on the native engine.

Each turn renders the whole conversation with the model's chat template as llama-server does (common/chat,
clover_cpp.chat_format), keeps what the engine's history already holds of it and prefills the rest
(``Model.reuse_prefix``; the Qwen template drops earlier turns' reasoning, so the reuse goes back to the checkpoint
where the previous answer started; docs/serve.md, "Prefix reuse"), then streams every committed block, split into
reasoning and content by llama-server's parser for the template's format. Reasoning is shown dimmed or hidden;
``--visual`` redraws the block canvas at every LowConfidence step, as llama-diffusion-cli's visual mode does.
Ctrl-C stops the answer being generated; the chat goes on.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from clover_common.errors import BadInput

from . import options, session
from .chat_format import AnswerParser, ChatTemplates, Rendered, TemplateError, TextEvent
from .gen_params import MODES, PARAMS, GenParams
from .model import EngineError, Generation, Model, Stats
from clover_native.loader import NativeError
from .text_stream import TextPipeline

HELP = """commands:
  /think on|off           reasoning (enable_thinking) for the next answers
  /mode auto|ar|diffusion|spec decoding mode
  /block N | default      block size B (1..{max_block})
  /threshold X | default  confidence threshold in [0, 1] (default: calibrated for B)
  /reset                  forget the conversation
  /save FILE              save the conversation and the engine's state (a session)
  /load FILE              resume a saved session without prefilling it again
  /stats                  statistics of the last answer and of the session
  /help                   this list
  /exit, /quit, Ctrl-D    leave
Ctrl-C stops the answer being generated; the chat goes on."""

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


@dataclass(frozen=True)
class Settings:
    """A chat's settings: the generation parameters of its turns (max_tokens caps each answer; ``stop_ids=()``
    is --ignore-eos) and whether thinking is on. /mode, /block, /threshold and /think change them."""

    gen: GenParams = GenParams(max_tokens=1024)
    enable_thinking: bool = True

    def with_gen(self, **fields: Any) -> "Settings":
        return replace(self, gen=self.gen.replace(**fields))


class Style:
    """ANSI styling, or none."""

    def __init__(self, color: bool) -> None:
        self.color = color

    def _wrap(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color and text else text

    def dim(self, text: str) -> str:
        return self._wrap("2", text)

    def bold(self, text: str) -> str:
        return self._wrap("1", text)

    def error(self, text: str) -> str:
        return self._wrap("31", text)

    def canvas(self, text: str) -> str:
        return self._wrap("36", text)


def use_color(choice: str, out: TextIO) -> bool:
    if choice != "auto":
        return choice == "always"
    return out.isatty() and os.environ.get("TERM", "") != "dumb" and "NO_COLOR" not in os.environ


@dataclass
class Turn:
    tokens: list[int]
    stats: Stats | None
    interrupted: bool
    reasoning: str
    content: str
    reused: int = 0  # prompt tokens kept from the history instead of prefilled


class AnswerPrinter:
    """Prints reasoning/content events; reasoning dimmed (or between <think> tags without color), or hidden."""

    def __init__(self, out: TextIO, style: Style, show_reasoning: bool) -> None:
        self.out = out
        self.style = style
        self.show_reasoning = show_reasoning
        self.channel: str | None = None
        self.reasoning = ""
        self.content = ""

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def event(self, ev: Any) -> None:
        if not isinstance(ev, TextEvent):
            return
        if ev.channel == "reasoning":
            self.reasoning += ev.text
            if not self.show_reasoning:
                return
            if self.channel != "reasoning":
                self.write(self.style.dim("thinking: ") if self.style.color else "<think>\n")
                self.channel = "reasoning"
            self.write(self.style.dim(ev.text))
        else:
            self.content += ev.text
            if self.channel == "reasoning":
                self.write("\n\n" if self.style.color else "\n</think>\n\n")
            self.channel = "content"
            self.write(ev.text)

    def close(self) -> None:
        if self.channel == "reasoning" and not self.style.color:
            self.write("\n</think>")
        self.write("\n")


class ChatApp:
    def __init__(self, model: Model, template: ChatTemplates, settings: Settings, max_block_size: int,
                 out: TextIO = sys.stdout, style: Style | None = None, show_reasoning: bool = True,
                 visual: bool = False, system: str | None = None) -> None:
        self.model = model
        self.template = template
        self.settings = settings
        self.max_block_size = max_block_size
        self.out = out
        self.style = style or Style(False)
        self.show_reasoning = show_reasoning
        self.visual = visual
        self.system = system
        self.messages: list[dict[str, Any]] = self._fresh_messages()
        self.last: Stats | None = None
        self.turns = 0
        self.total_tokens = 0
        self.total_decode_ms = 0.0
        self._identity: dict[str, Any] | None = None  # the GGUF's identity for sessions, computed once

    def _fresh_messages(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    # ------------------------------------------------------------------------------ loop
    def banner(self) -> None:
        info, s = self.model.info, self.settings
        name = Path(self.model.path).name
        self.say(self.style.bold(f"clover-cpp chat: {name}") + self.style.dim(
            f" (n_ctx {self.model.n_ctx}, B {info.block_size}, max B {self.max_block_size}, "
            f"threshold {info.threshold:.3g})"))
        self.say(self.style.dim(f"mode {s.gen.mode}, thinking {'on' if s.enable_thinking else 'off'}. /help lists the "
                                "commands; Ctrl-C stops an answer; Ctrl-D or /exit quits."))

    def loop(self, read: Callable[[str], str] = input) -> int:
        self.banner()
        while True:
            try:
                line = read("> ")
            except EOFError:
                self.say()
                return 0
            except KeyboardInterrupt:
                self.say()
                self.say(self.style.dim("(Ctrl-C stops an answer; /exit or Ctrl-D quits)"))
                continue
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return 0
                continue
            self.answer(line)

    # ------------------------------------------------------------------------------ commands
    def command(self, line: str) -> bool:
        """Run a /command; False to leave."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        s = self.settings
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.say(HELP.format(max_block=self.max_block_size))
        elif name == "/think":
            if arg not in ("on", "off", ""):
                self.fail("usage: /think on|off")
            else:
                if arg:
                    self.settings = replace(s, enable_thinking=arg == "on")
                self.say(self.style.dim(f"thinking {'on' if self.settings.enable_thinking else 'off'}"))
        elif name == "/mode":
            if arg not in (*MODES, ""):
                self.fail(f"usage: /mode {'|'.join(MODES)}")
            else:
                if arg:
                    self.settings = s.with_gen(mode=arg)
                self.say(self.style.dim(f"mode {self.settings.gen.mode}"))
        elif name == "/block":
            self._set_block(arg)
        elif name == "/threshold":
            self._set_threshold(arg)
        elif name == "/reset":
            self.messages = self._fresh_messages()
            self.model.reset()
            self.say(self.style.dim("conversation cleared"))
        elif name == "/stats":
            self.show_stats()
        elif name == "/save":
            self.save(arg)
        elif name == "/load":
            self.load(arg)
        else:
            self.fail(f"unknown command {name}; /help lists the commands")
        return True

    def _set_block(self, arg: str) -> None:
        max_block = self.max_block_size
        self._set_gen("block_size", arg, int, lambda b: 1 <= b <= max_block,
                      f"/block takes an integer in 1..{max_block} (start with --max-block-size for more)",
                      lambda given: f"block size {self.settings.gen.block_size or self.model.info.block_size}"
                                    + (f", threshold {self._threshold_text()}" if given else ""))

    def _set_threshold(self, arg: str) -> None:
        bound = PARAMS["threshold"].bound
        self._set_gen("threshold", arg, float, bound.ok, f"/threshold takes a number ({bound.rule}), or 'default'",
                      lambda _given: f"threshold {self._threshold_text()}")

    def _set_gen(self, field: str, arg: str, parse: Callable[[str], Any], ok: Callable[[Any], bool], usage: str,
                 shown: Callable[[bool], str]) -> None:
        """/block and /threshold: a value ``ok`` accepts sets the field, 'default' restores the GGUF's, nothing shows
        it; anything else prints ``usage``. ``shown(given)`` says the setting after a change or a look."""
        given = arg not in ("default", "")
        if given:
            try:
                value = parse(arg)
            except ValueError:
                value = None
            if value is None or not ok(value):
                self.fail(usage)
                return
            self.settings = self.settings.with_gen(**{field: value})
        elif arg:
            self.settings = self.settings.with_gen(**{field: None})
        self.say(self.style.dim(shown(given)))

    # ------------------------------------------------------------------------------ sessions
    def model_identity(self) -> dict[str, Any]:
        if self._identity is None:
            self._identity = session.model_identity(self.model)
        return self._identity

    def _history_to_save(self) -> list[int]:
        """Cut the engine's history to what the next turn keeps of it, and return its tokens ([] when nothing
        can be kept). The next prompt re-renders the last answer (its reasoning dropped), so the history goes
        back to the checkpoint before it, as the next turn's reuse_prefix would; a loaded session then prefills
        exactly what the uninterrupted one would."""
        if self.model.n_past == 0 or not any(m["role"] == "assistant" for m in self.messages):
            return []
        probe = self.messages + [{"role": "user", "content": "."}]  # any next message shares this much
        try:
            ids = self.model.tokenize(self.template.render(probe, enable_thinking=self.settings.enable_thinking).prompt)
        except (TemplateError, NativeError):
            return []
        return ids[:self.model.reuse_prefix(ids)]

    def save(self, path: str) -> None:
        if not path:
            self.fail("usage: /save FILE")
            return
        tokens = self._history_to_save()
        state = b""
        if tokens:
            try:
                state = self.model.history_state()
            except EngineError as exc:
                self.say(self.style.dim(f"(the engine state is not saved: {exc})"))
                tokens = []
        s = self.settings
        header = {
            "format": session.FORMAT_VERSION, "clover_version": session.toolkit_version(),
            "model": self.model_identity(),
            "engine": {"n_ctx": self.model.n_ctx, "max_block_size": self.max_block_size},
            "chat": {"mode": s.gen.mode, "block_size": s.gen.block_size, "threshold": s.gen.threshold,
                     "thinking": s.enable_thinking, "system": self.system},
            "messages": self.messages, "tokens": tokens, "n_past": len(tokens),
        }
        try:
            size = session.write(path, header, state)
        except session.SessionError as exc:
            self.fail(str(exc))
            return
        held = (f"{len(tokens)} tokens of engine state" if tokens
                else "no engine state (the next turn after /load prefills the conversation)")
        self.say(self.style.dim(f"saved {path}: {len(self.messages)} messages, {held}, {size} bytes"))

    def load(self, path: str) -> None:
        if not path:
            self.fail("usage: /load FILE")
            return
        try:
            sess = session.read(path, self.model_identity(), self.model.n_ctx, self.model.info.n_vocab, MODES)
        except session.SessionError as exc:
            self.fail(" ".join(str(exc).split()))
            return
        st = sess.settings
        block, note = st["block_size"], ""
        if block is not None and block > self.max_block_size:
            note = f"; its block size {block} exceeds --max-block-size {self.max_block_size}, kept the current one"
            block = self.settings.gen.block_size
        try:
            self.model.restore_history(sess.tokens, sess.state)
        except EngineError as exc:  # the engine was reset; the current conversation stays (its next turn prefills)
            self.fail(f"{path}: state: " + " ".join(str(exc).split()))
            return
        self.messages = sess.messages
        self.system = st["system"]
        self.settings = replace(self.settings.with_gen(mode=st["mode"], block_size=block, threshold=st["threshold"]),
                                enable_thinking=st["thinking"])
        self.say(self.style.dim(
            f"loaded {path}: {len(self.messages)} messages, {len(sess.tokens)} tokens of history restored "
            f"(mode {st['mode']}, thinking {'on' if st['thinking'] else 'off'}{note})"))

    def _threshold_text(self) -> str:
        if self.settings.gen.threshold is not None:
            return f"{self.settings.gen.threshold:g}"
        b = self.settings.gen.block_size or self.model.info.block_size
        return f"{self.model.info.threshold_for(b):.3g} (calibrated for B = {b})"

    def fail(self, message: str) -> None:
        self.say(self.style.error(f"error: {message}"))

    def show_stats(self) -> None:
        if self.last is None:
            self.say(self.style.dim("no answer yet"))
            return
        for key, value in self.last.to_dict().items():
            shown = f"{value:.4g}" if isinstance(value, float) else value
            self.say(self.style.dim(f"  {key:<20} {shown}"))
        rate = self.total_tokens / (self.total_decode_ms / 1e3) if self.total_decode_ms > 0 else 0.0
        self.say(self.style.dim(f"  session: {self.turns} answers, {self.total_tokens} tokens, {rate:.1f} tok/s"))

    # ------------------------------------------------------------------------------ a turn
    def answer(self, text: str) -> None:
        s = self.settings
        self.messages.append({"role": "user", "content": text})
        try:
            rendered = self.template.render(self.messages, enable_thinking=s.enable_thinking)
            ids = self.model.tokenize(rendered.prompt)
        except (TemplateError, NativeError) as exc:
            self.messages.pop()
            self.fail(str(exc))
            return
        room = self.model.n_ctx - len(ids)
        if room < 1:
            self.messages.pop()
            self.fail(f"the conversation has {len(ids)} tokens and fills the context ({self.model.n_ctx}); "
                      "/reset to start over")
            return
        try:
            turn = self._generate(text, ids, min(s.gen.max_tokens, room), rendered, self._answer_start(rendered, ids))
        except (ValueError, NativeError) as exc:
            self.messages.pop()
            self.fail(" ".join(str(exc).split()))
            return
        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.reasoning:
            message["reasoning_content"] = turn.reasoning
        self.messages.append(message)
        if turn.stats is not None:
            self.last = turn.stats
            self.turns += 1
            self.total_tokens += turn.stats.generated_tokens
            self.total_decode_ms += turn.stats.decode_ms
            self.say(self.style.dim(self.stats_line(turn.stats, turn.interrupted, turn.reused)))

    def stats_line(self, st: Stats, interrupted: bool, reused: int = 0) -> str:
        head = "[ar]" if st.mode == "ar" else f"[{st.mode} B={st.block_size} threshold={st.threshold:.3g}]"
        stop = "interrupted" if interrupted else st.stop_reason
        return (f"{head} {st.generated_tokens} tokens, {st.decode_tok_s:.1f} tok/s, TPF {st.tokens_per_pass:.2f}, "
                f"prefill {st.prompt_tokens} tokens{f' ({reused} reused)' if reused else ''}, "
                f"{st.threads} thread{'s' * (st.threads != 1)}, stop: {stop}")

    def _answer_start(self, rendered: Rendered, ids: list[int]) -> int:
        """Where the generation prompt starts in ``ids``: the conversation before it is what the next turn's prompt
        shares with this one, since the answer is re-rendered with its reasoning dropped. 0 when that is not a token
        prefix of ``ids``."""
        head = rendered.head
        if not head:
            return 0
        head_ids = self.model.tokenize(head)
        n = len(head_ids)
        return n if 0 < n < len(ids) and list(ids[:n]) == head_ids else 0

    def _generate(self, user_text: str, ids: list[int], max_tokens: int, rendered: Rendered,
                  checkpoint_hint: int = 0) -> Turn:
        visual = self.visual and self.settings.gen.mode != "ar"
        # the previous turns' prompt, up to where their answer started
        reused = self.model.reuse_prefix(ids, checkpoint_at=[checkpoint_hint])
        run = self.model.generate(ids[reused:], self.settings.gen, max_tokens=max_tokens, steps=visual,
                                  **self._grammar_after(rendered))
        printer = AnswerPrinter(self.out, self.style, self.show_reasoning)
        parser = AnswerParser(rendered, parse_tools=False)
        pipeline = TextPipeline(lambda t: self.model.detokenize(t, special=False), parser=parser)
        tokens: list[int] = []
        steps = 0
        error: BaseException | None = None
        try:
            with cancel_on_sigint(run):
                for kind, payload in run.events():
                    if kind == "step":
                        steps += 1
                        self._frame(user_text, tokens, payload, steps)
                        continue
                    tokens += payload
                    if visual:
                        self._frame(user_text, tokens, None, steps)
                    else:
                        for ev in pipeline.feed(payload):
                            printer.event(ev)
        except (EngineError, NativeError) as exc:  # raised once what was generated is printed
            error = exc
        finally:
            run.close()  # the consumer stopped early (an exception in printing): stop the engine too
        if visual:  # the last frame: the answer as a normal turn
            self.out.write(CLEAR + self.style.bold("> ") + user_text + "\n")
            tail = parser.feed(self.model.detokenize(tokens, special=False)) + parser.finish()
        else:
            tail = pipeline.finish()
        for ev in tail:
            printer.event(ev)
        printer.close()
        if run.cancelled:
            self.say(self.style.error("[interrupted]"))
        if error is not None:
            raise error
        assert run.stats is not None
        answer = parser.answer
        return Turn(tokens, run.stats, run.cancelled, answer.reasoning, answer.content, reused)

    def _grammar_after(self, rendered: Rendered) -> dict[str, Any]:
        """With a grammar (--grammar, -j, ...) and an answer that opens with reasoning, the grammar applies after
        the end of the thinking block: the reasoning stays free (as in serve; docs/decoding.md, "Constrained
        decoding")."""
        if not self.settings.gen.grammar or not rendered.in_reasoning:
            return {}
        end = rendered.thinking_end or ""
        ids = self.model.tokenize(end) if end else []
        if len(ids) != 1:
            raise BadInput(f"a grammar with thinking needs the end of thinking ({end or 'none known'}) as one "
                           "token of the vocabulary; /think off")
        return {"grammar_after_ids": (ids[0],)}

    def _frame(self, user_text: str, tokens: list[int], canvas: list[int] | None, step: int) -> None:
        """One visual frame: the committed text, then the block canvas (masked targets as '_')."""
        mask = self.model.info.mask_token_id
        text = self.model.detokenize(tokens, special=False)
        shown = ""
        if canvas is not None:
            shown = "".join(self.style.dim("_") if t == mask
                            else self.style.canvas(self.model.detokenize([t], special=False)) for t in canvas)
        s = self.settings
        head = f"[{s.gen.mode} B={s.gen.block_size or self.model.info.block_size}] step {step}, {len(tokens)} tokens"
        self.out.write(CLEAR + self.style.bold("> ") + user_text + "\n" + text + shown + "\n\n"
                       + self.style.dim(head) + "\n")
        self.out.flush()


@contextmanager
def cancel_on_sigint(run: Generation) -> Iterator[None]:
    """Ctrl-C (SIGINT) cancels ``run`` (the engine stops at its next callback) instead of raising
    KeyboardInterrupt in the app; only from the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: run.cancel())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_chat(args: argparse.Namespace) -> int:
    settings = Settings(options.gen_params(args, stop_ids=() if args.ignore_eos else None),
                        enable_thinking=args.think == "on")
    model = options.open_model(args)  # with the prefix cache of --cache-ram (docs/serve.md)
    try:
        options.check_grammar(model, args, settings.gen)
        template = ChatTemplates.load(model.llama_model, args.model, args.chat_template)
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        app = ChatApp(model, template, settings, model.max_block_size, sys.stdout,
                      Style(use_color(args.color, sys.stdout)), show_reasoning=args.reasoning == "show",
                      visual=args.visual, system=args.system)
        return app.loop()
    finally:
        model.close()
