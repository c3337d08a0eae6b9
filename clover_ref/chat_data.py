"""Synthetic chat for the demo model's second training stage (docs/training.md), seeded.

Four kinds of conversation, rendered with the shipped chat template (the Qwen3.5 family's):
- a code question with a short answer that ends the turn: what a standard-library function does (the first
  line of its own docstring), or a small function to write;
- the same with thinking on: a short reasoning block before the answer;
- a tool call in the template's XML format: the system prompt lists one to four tools, the user's request names
  one and gives its arguments, and the assistant calls it with those arguments;
- the tool's result comes back and the assistant answers with it.

Every value that fills a conversation (the functions asked about, file paths, commands, search terms, contents)
falls in the training split or the held-out split by a hash of the value, so held-out conversations ask about
functions and name paths the training stage never saw. ``examples(split, n, seed)`` draws them.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import random
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

Message = dict[str, Any]
HELD_OUT_EVERY = 5  # a value is held out when crc32(value) % 5 == 0
SPLITS = ("train", "held-out")

MODULES = ("os", "os.path", "json", "re", "math", "string", "itertools", "functools", "collections", "shutil",
           "textwrap", "random", "statistics", "heapq", "bisect", "operator", "glob", "fnmatch", "copy", "time",
           "base64", "binascii", "hashlib", "zlib", "csv", "difflib", "inspect", "keyword", "platform", "pprint",
           "secrets", "shlex", "struct", "tempfile", "unicodedata", "urllib.parse", "uuid", "warnings", "calendar",
           "colorsys", "html", "locale", "posixpath", "stat", "tokenize", "types", "typing", "weakref", "zipfile")


def split_of(value: str) -> str:
    return "held-out" if zlib.crc32(value.encode()) % HELD_OUT_EVERY == 0 else "train"


def _first_sentence(doc: str) -> str | None:
    line = doc.strip().split("\n\n")[0].replace("\n", " ")
    line = re.split(r"(?<=\.)\s", line)[0].strip()
    if not 16 <= len(line) <= 110 or not line.isascii() or not line[0].isupper() or "(" in line[:3]:
        return None
    return line if line.endswith(".") else line + "."


@lru_cache(maxsize=1)
def documented_functions() -> tuple[tuple[str, str], ...]:
    """(qualified name, the first sentence of its docstring) of the standard library's public functions."""
    found: dict[str, str] = {}
    sources = [("", builtins)] + [(name + ".", importlib.import_module(name)) for name in MODULES]
    for prefix, module in sources:
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not callable(obj) or inspect.isclass(obj):
                continue
            sentence = _first_sentence(inspect.getdoc(obj) or "")
            if sentence:
                found.setdefault(prefix + attr, sentence)
    return tuple(sorted(found.items()))


WORDS = ("parser", "config", "cache", "server", "client", "models", "views", "utils", "helpers", "loader",
         "reader", "writer", "report", "session", "router", "schema", "worker", "queue", "events", "metrics",
         "storage", "index", "search", "tokens", "format", "layout", "render", "engine", "planner", "scheduler",
         "network", "socket", "buffer", "stream", "logger", "errors", "checks", "export", "import_tool", "cli",
         "main", "app", "api", "auth", "users", "orders", "billing", "payments", "invoice", "graph", "nodes",
         "matrix", "vector", "shapes", "colors", "images", "audio", "video", "notes", "tasks", "jobs", "timer",
         "clock", "calendar_view", "mailer", "backup", "restore", "upload", "download", "sync", "diff", "merge",
         "patch", "build", "deploy", "release", "version", "plugins", "hooks", "signals", "store", "state",
         "history", "undo", "keymap", "theme", "fonts", "widgets", "dialog", "editor", "terminal", "shell")
DIRS = ("src", "lib", "tests", "app", "core", "scripts", "tools", "pkg", "docs", "examples")
IDENTIFIERS = ("load_config", "parse_args", "read_rows", "write_report", "connect", "retry", "normalize",
               "tokenize_line", "render_page", "send_mail", "compute_total", "merge_sorted", "flatten", "chunked",
               "find_user", "update_index", "open_session", "close_session", "validate", "serialize", "to_json",
               "from_json", "hash_file", "copy_tree", "walk_files", "count_words", "top_k", "moving_average",
               "clamp", "lerp", "dot", "transpose", "fibonacci", "factorial", "is_prime", "gcd", "lcm",
               "binary_search", "quick_sort", "dedupe", "group_by", "parse_date", "format_bytes", "slugify",
               "camel_to_snake", "snake_to_camel", "strip_tags", "escape_html", "unescape", "checksum")
COMMANDS = ("pytest -q", "ls -la", "git status", "git log --oneline -5", "make build", "make test", "pip list",
            "python --version", "du -sh .", "df -h", "uname -a", "whoami", "date", "git diff --stat",
            "npm test", "cargo build", "go test ./...", "ruff check .", "mypy src", "env")


def _pick(rng: random.Random, pool: tuple[str, ...] | list[str], split: str) -> str:
    """A value of ``pool`` in ``split`` (both splits are non-empty for every pool here)."""
    return rng.choice([v for v in pool if split_of(v) == split])


def _path(rng: random.Random, split: str) -> str:
    return f"{_pick(rng, DIRS, split)}/{_pick(rng, WORDS, split)}.py"


def _number(rng: random.Random) -> int:
    return rng.randint(2, 999)


def _assignment(rng: random.Random, split: str) -> str:
    return f"{_pick(rng, IDENTIFIERS, split)} = {_number(rng)}"


@dataclass(frozen=True)
class Tool:
    """A function tool: its OpenAI-style definition and how a user asks for it (its result: TOOL_RESULTS)."""
    name: str
    description: str
    params: dict[str, str]  # name -> description (all required, all strings)
    arguments: Callable[[random.Random, str], dict[str, str]]
    requests: tuple[str, ...]  # str.format templates over the tool's name and arguments

    def definition(self, rng: random.Random) -> dict[str, Any]:
        """The OpenAI tool definition; clients differ in what they describe, so the descriptions come and go."""
        described = rng.random() < 0.5
        properties = {k: {"type": "string", **({"description": v} if described else {})}
                      for k, v in self.params.items()}
        # llama-server renders a tool without a description with "description": "" (common/chat's tool list)
        function = {"name": self.name, "description": self.description if rng.random() < 0.8 else ""}
        parameters = {"type": "object", "properties": properties, "required": list(self.params)}
        if rng.random() < 0.5:  # the key order pydantic's schemas have
            parameters = {"properties": properties, "required": list(self.params), "type": "object"}
        return {"type": "function", "function": {**function, "parameters": parameters}}


def _read_result(rng: random.Random, args: dict[str, str], split: str) -> tuple[str, str]:
    name, value = _pick(rng, IDENTIFIERS, split), _number(rng)
    return (f"def {name}():\n    return {value}",
            f"{args['path']} defines `{name}`, which returns {value}.")


def _run_result(rng: random.Random, args: dict[str, str], split: str) -> tuple[str, str]:
    if rng.random() < 0.5:
        code = rng.choice((0, 0, 1, 2))
        return f"exit code {code}", f"`{args['command']}` finished with exit code {code}."
    word = _pick(rng, WORDS, split)
    return f"{word}: ok", f"`{args['command']}` printed `{word}: ok`."


def _list_result(rng: random.Random, args: dict[str, str], split: str) -> tuple[str, str]:
    names = sorted({f"{_pick(rng, WORDS, split)}.py" for _ in range(rng.randint(1, 4))})
    return "\n".join(names), f"{args['path']} holds {len(names)} file{'s' * (len(names) > 1)}: {', '.join(names)}."


def _search_result(rng: random.Random, args: dict[str, str], split: str) -> tuple[str, str]:
    path, line = _path(rng, split), _number(rng)
    return (f"{path}:{line}: def {args['query']}(",
            f"`{args['query']}` is defined in {path}, line {line}.")


def _write_result(rng: random.Random, args: dict[str, str], split: str) -> tuple[str, str]:
    return f"wrote {len(args['content'])} bytes", f"Done: {args['path']} now holds `{args['content']}`."


def _test_result(rng: random.Random, args: dict[str, str], split: str) -> tuple[str, str]:
    passed, failed = rng.randint(1, 60), rng.choice((0, 0, 0, 1, 2))
    summary = f"{passed} passed" + (f", {failed} failed" if failed else "")
    return summary, f"The tests in {args['path']}: {summary}."


TOOLS = (
    Tool("read_file", "Read a text file and return its contents.", {"path": "The file's path."},
         lambda rng, split: {"path": _path(rng, split)},
         ("Use read_file to show me {path}.", "Call read_file on {path}.", "Read {path} with the read_file tool.",
          "Open {path} (read_file).", "What is in {path}? Use read_file.")),
    Tool("run_command", "Run a shell command and return its output.", {"command": "The command line."},
         lambda rng, split: {"command": _pick(rng, COMMANDS, split)},
         ("Use run_command to run `{command}`.", "Run `{command}` with run_command.",
          "Call run_command with `{command}`.", "Please run_command: `{command}`.")),
    Tool("list_directory", "List the files in a directory.", {"path": "The directory."},
         lambda rng, split: {"path": _pick(rng, DIRS, split) + "/" + _pick(rng, WORDS, split)},
         ("Use list_directory on {path}.", "List {path} with list_directory.",
          "Call list_directory for {path}.")),
    Tool("search_code", "Search the code base for a symbol.", {"query": "The symbol to look for."},
         lambda rng, split: {"query": _pick(rng, IDENTIFIERS, split)},
         ("Use search_code to find {query}.", "Where is {query} defined? Use search_code.",
          "Call search_code with {query}.")),
    Tool("write_file", "Write text to a file, replacing it.", {"path": "The file's path.", "content": "The text."},
         lambda rng, split: {"path": _path(rng, split), "content": _assignment(rng, split)},
         ("Use write_file to write `{content}` to {path}.", "Call write_file: put `{content}` in {path}.",
          "Write `{content}` into {path} with write_file.")),
    Tool("run_tests", "Run the test suite of a path.", {"path": "The tests' path."},
         lambda rng, split: {"path": "tests/test_" + _pick(rng, WORDS, split) + ".py"},
         ("Use run_tests on {path}.", "Call run_tests for {path}.", "Run the tests in {path} with run_tests.")),
)
TOOL_RESULTS = {"read_file": _read_result, "run_command": _run_result, "list_directory": _list_result,
                "search_code": _search_result, "write_file": _write_result, "run_tests": _test_result}

QUESTIONS = ("What does `{name}` do?", "Explain `{name}` in one sentence.", "What is `{name}` for?",
             "In Python, what does {name}() do?", "Briefly: what does `{name}` do?")
OPERATIONS = (("sum", "+"), ("difference", "-"), ("product", "*"), ("quotient", "/"), ("remainder", "%"),
              ("power", "**"), ("floor quotient", "//"))
SYSTEM_PROMPTS = (None, None, "You are a helpful coding assistant.", "You are a concise assistant for Python.",
                  "Answer briefly.")


@dataclass
class Example:
    """One conversation: the messages, the tool definitions the system prompt lists, and the thinking switch."""
    kind: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    enable_thinking: bool = False
    expected_call: dict[str, Any] | None = field(default=None)  # name and arguments, for tool kinds

    def prompt_messages(self) -> list[Message]:
        """The conversation up to the first assistant turn: what an evaluation sends."""
        return self.messages[:next(i for i, m in enumerate(self.messages) if m["role"] == "assistant")]


def _system(rng: random.Random) -> list[Message]:
    prompt = rng.choice(SYSTEM_PROMPTS)
    return [{"role": "system", "content": prompt}] if prompt else []


def code_question(rng: random.Random, split: str, thinking: bool) -> Example:
    if rng.random() < 0.75:
        name, sentence = rng.choice([f for f in documented_functions() if split_of(f[0]) == split])
        question = rng.choice(QUESTIONS).format(name=name)
        answer = f"`{name}`: {sentence}"
        reasoning = f"The user asks about `{name}`. Its documentation says: {sentence}"
    else:
        what, op = rng.choice(OPERATIONS)
        fname = _pick(rng, IDENTIFIERS, split)
        question = f"Write a Python function `{fname}` that returns the {what} of two numbers."
        answer = f"```python\ndef {fname}(a, b):\n    return a {op} b\n```"
        reasoning = f"The {what} of a and b is `a {op} b`."
    reply: Message = {"role": "assistant", "content": answer}
    if thinking:
        reply["reasoning_content"] = reasoning
    return Example("question", _system(rng) + [{"role": "user", "content": question}, reply],
                   enable_thinking=thinking)


def tool_exchange(rng: random.Random, split: str, thinking: bool) -> Example:
    listed = rng.sample(TOOLS, rng.randint(1, 4))
    tool = rng.choice(listed)
    args = tool.arguments(rng, split)
    request = rng.choice(tool.requests).format(name=tool.name, **args)
    output, final = TOOL_RESULTS[tool.name](rng, args, split)
    call: Message = {"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": tool.name, "arguments": args}}]}
    if thinking:
        call["reasoning_content"] = f"The user wants {tool.name} with {', '.join(args.values())}."
    messages = _system(rng) + [{"role": "user", "content": request}, call,
                               {"role": "tool", "content": output}, {"role": "assistant", "content": final}]
    return Example("tool", messages, [t.definition(rng) for t in listed], thinking,
                   {"name": tool.name, "arguments": args})


def examples(split: str, n: int, seed: int, kinds: tuple[str, ...] = ("question", "tool"),
             thinking_share: float = 0.5) -> Iterator[Example]:
    """``n`` conversations of ``split`` drawn with ``seed``, the kinds in turn, thinking on at ``thinking_share``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    rng = random.Random(f"{split}:{seed}")
    makers = {"question": code_question, "tool": tool_exchange}
    for i in range(n):
        yield makers[kinds[i % len(kinds)]](rng, split, rng.random() < thinking_share)
