"""Special files in every file a tool reads, for the fuzz tests (tests/convert/test_fuzz.py).

``SLOTS`` lists every place where a Python tool reads a file the user names: an option's value ({FILE} in the
command line) or a file of the checkpoint folder given ({DIR}, a copy of the base checkpoint where ``member`` is
replaced), and the checkpoint folder itself. ``cases`` puts each of ``SPECIALS`` there (a fifo, /dev/zero,
/dev/null, a directory, a link that leads nowhere, a link to a fifo, a sparse file one byte over the kind's cap,
a missing file where the file is required) and says what the one-line error must name: the path, what it is, and
the option. The command lines run through fuzz_gguf's runner (tool ``cli``), many to a process.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clover_common.input_files import (CALIBRATION_TEXT, CHAT_TEMPLATE, CONFIG, GGUF, GRAMMAR, IMATRIX,
                                       JSON_SCHEMA, MODEL_CARD, SAFETENSORS, TOKENIZER, WEIGHT_INDEX, InputKind,
                                       size_text)

DIRECTORY = None  # the kind of a slot that names a folder


@dataclass(frozen=True)
class Slot:
    """One file a tool reads. ``argv``: the command line after the script's name, with {FILE} (the special file),
    {DIR} (the case's copy of ``base``), {GGUF} (a good GGUF) and {OUT} (an output that must not appear)."""

    prog: str
    argv: tuple[str, ...]
    kind: InputKind | None  # None: a folder
    flag: str | None = None  # the option the message names
    member: str | None = None  # the file of {DIR} that is replaced (else {FILE} is the special file)
    base: str = "tiny"  # tiny | sharded (checkpoints) | split (a split GGUF: the first shard good, the second special)
    remove: tuple[str, ...] = ()  # files of {DIR} removed first (chat_template.json is read only without the .jinja)
    optional: bool = False  # absent is fine: no "missing" case
    native: bool = False  # needs the native build

    @property
    def name(self) -> str:
        """e.g. "clover-cpp-generate--grammar-file", "clover-convert-config.json", "clover-quantize-IN"."""
        command = [] if self.argv[0].startswith("{") else [self.argv[0]]
        what = self.flag or self.member or ("IN" if "{FILE}" in self.argv else "DIR")
        extra = ["bd-only"] if "--bd-only" in self.argv else []
        return "-".join([self.prog, *command, what, *extra]).replace("/", "_")


CONVERT = ("{DIR}", "{OUT}", "--outtype", "f32", "--threads", "1")
REF = ("generate", "{DIR}", "-p", "x", "-n", "1")
GENERATE = ("generate", "-m", "{GGUF}", "-p", "x", "-n", "1", "-c", "64", "-t", "1")
CHAT = ("chat", "-m", "{GGUF}", "-c", "64", "-t", "1")
SERVE = ("serve", "-m", "{GGUF}", "-c", "64", "-t", "1", "--port", "0")  # llama-server: its own file options
# are tested in tests/native/test_arg_input_files.py; here, the model clover-cpp serve reads before it starts
IMATRIX_CMD = ("imatrix", "-m", "{GGUF}", "-f", "{GGUF}", "-o", "{OUT}")

SLOTS: tuple[Slot, ...] = (
    # clover-convert: the checkpoint folder, its files, and the file options
    Slot("clover-convert", CONVERT, DIRECTORY),
    *(Slot("clover-convert", CONVERT, kind, member=member, optional=optional) for member, kind, optional in (
        ("config.json", CONFIG, False), ("tokenizer.json", TOKENIZER, False), ("tokenizer_config.json", CONFIG, True),
        ("generation_config.json", CONFIG, True), ("chat_template.jinja", CHAT_TEMPLATE, True),
        ("additional_chat_templates/tools.jinja", CHAT_TEMPLATE, True), ("README.md", MODEL_CARD, True),
        ("model.safetensors", SAFETENSORS, False))),
    Slot("clover-convert", CONVERT, CHAT_TEMPLATE, member="chat_template.json", remove=("chat_template.jinja",),
         optional=True),
    Slot("clover-convert", CONVERT, WEIGHT_INDEX, member="model.safetensors.index.json", base="sharded",
         optional=True),
    Slot("clover-convert", CONVERT, SAFETENSORS, member="model-00002-of-00005.safetensors", base="sharded"),
    Slot("clover-convert", (*CONVERT, "--metadata", "{FILE}"), CONFIG, "--metadata"),
    Slot("clover-convert", ("{DIR}", "--bd-only", "{OUT}", "--metadata", "{FILE}"), CONFIG, "--metadata"),
    Slot("clover-convert", ("{DIR}", "{OUT}", "--outtype", "Q8_0", "--imatrix", "{FILE}"), IMATRIX, "--imatrix"),
    # clover-ref generate: the checkpoint folder and the files it reads
    Slot("clover-ref", REF, DIRECTORY),
    *(Slot("clover-ref", REF, kind, member=member, optional=optional) for member, kind, optional in (
        ("config.json", CONFIG, False), ("tokenizer.json", TOKENIZER, False), ("generation_config.json", CONFIG, True),
        ("model.safetensors", SAFETENSORS, False))),
    Slot("clover-ref", REF, WEIGHT_INDEX, member="model.safetensors.index.json", base="sharded", optional=True),
    Slot("clover-ref", REF, SAFETENSORS, member="model-00002-of-00005.safetensors", base="sharded"),
    # clover-quantize: the input, a split input's shard, --imatrix
    Slot("clover-quantize", ("{FILE}", "{OUT}", "Q8_0"), GGUF, native=True),
    Slot("clover-quantize", ("{DIR}/m-00001-of-00002.gguf", "{OUT}", "Q8_0"), GGUF, member="m-00002-of-00002.gguf",
         base="split", native=True),
    Slot("clover-quantize", ("{GGUF}", "{OUT}", "Q4_K_M", "--imatrix", "{FILE}"), IMATRIX, "--imatrix", native=True),
    # clover-cpp: every file option of generate, chat and imatrix, and serve's model
    *(Slot("clover-cpp", (*command[:2], "{FILE}", *command[3:]), GGUF, "-m/--model", native=True)
      for command in (GENERATE, CHAT, SERVE, IMATRIX_CMD)),
    *(Slot("clover-cpp", (*command, "--bd", "{FILE}"), GGUF, "--bd", native=True)
      for command in (GENERATE, CHAT, IMATRIX_CMD)),
    *(Slot("clover-cpp", (*command, option, "{FILE}"), kind, flag, native=True)
      for command in (GENERATE, CHAT) for option, kind, flag in (("--grammar-file", GRAMMAR, "--grammar-file"),
                                                                 ("-jf", JSON_SCHEMA, "-jf/--json-schema-file"))),
    *(Slot("clover-cpp", (*command, "--chat-template", "{FILE}"), CHAT_TEMPLATE, "--chat-template", native=True)
      for command in (CHAT,)),
    Slot("clover-cpp", (*IMATRIX_CMD[:4], "{FILE}", *IMATRIX_CMD[5:]), CALIBRATION_TEXT, "-f/--file", native=True),
)


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _fifo_link(p: Path) -> None:
    os.mkfifo(p.with_name(p.name + ".fifo"))
    p.symlink_to(p.name + ".fifo")


# name -> (make it at a path, what a file slot's message says, what a folder slot's message says); None: not for
# that kind of slot. /dev/zero and /dev/null are given as they are to an option, and linked to from a checkpoint.
SPECIALS: dict[str, tuple[Callable[[Path], None] | str | None, str | None, str | None]] = {
    "fifo": (_fifo, "is a fifo (named pipe), not a regular file", "is a fifo (named pipe), not a directory"),
    "fifo-link": (_fifo_link, "is a fifo (named pipe), not a regular file", "is a fifo (named pipe), not a directory"),
    "dev-zero": ("/dev/zero", "is a character device, not a regular file", "is a character device, not a directory"),
    "dev-null": ("/dev/null", "is a character device, not a regular file", None),
    "directory": (lambda p: p.mkdir(), "is a directory, not a file", None),
    "dangling-link": (lambda p: p.symlink_to(p.name + ".nowhere"), "is a symbolic link that leads nowhere",
                      "is a symbolic link that leads nowhere"),
    "regular-file": (lambda p: p.write_text("x"), None, "is a file, not a directory"),
    "too-large": (None, "files may have at most", None),  # a sparse file: made by ``make_special`` from the slot's cap
    "missing": (lambda p: None, "no such file", "no such directory"),
}


@dataclass(frozen=True)
class Case:
    name: str
    slot: Slot
    argv: list[str]  # the console script's name first
    path: str  # the path the message must name
    expect: tuple[str, ...]  # all in the one line: the path, what it is, the option


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (no disk, and the path stays in the folder), else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def make_special(special: str, path: Path, kind: InputKind | None) -> str:
    """Put ``special`` at ``path``; the path to give (``path``, or /dev/zero itself for an option)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    make = SPECIALS[special][0]
    if special == "too-large":
        assert kind is not None and kind.max_bytes is not None
        with open(path, "wb") as f:
            f.truncate(kind.max_bytes + 1)  # sparse: no disk
    elif isinstance(make, str):
        return make
    elif make is not None:
        make(path)
    return str(path)


def applies(slot: Slot, special: str) -> bool:
    _, file_says, folder_says = SPECIALS[special]
    if slot.kind is DIRECTORY:
        return folder_says is not None
    if file_says is None or (special == "missing" and (slot.optional or slot.member is not None)):
        return False  # a missing checkpoint file has messages of its own (tests/convert/test_convert_errors.py)
    return special != "too-large" or slot.kind.max_bytes is not None


def cases(root: Path, bases: dict[str, Path], gguf: Path | None, native: bool) -> list[Case]:
    """Every (slot, special) pair that applies, materialized under ``root``: ``bases`` maps tiny and sharded to
    checkpoint folders; ``gguf`` is a good GGUF (needed by the native slots, which run only with ``native``)."""
    out: list[Case] = []
    for slot in SLOTS:
        if slot.native != native:
            continue
        for special in SPECIALS:
            if not applies(slot, special):
                continue
            name = f"{slot.name}-{special}".replace(" ", "-")
            where = root / name
            where.mkdir(parents=True)
            fields = {"OUT": str(where / "out.gguf"), "GGUF": str(gguf)}
            if slot.kind is DIRECTORY:
                fields["DIR"] = path = make_special(special, where / "model", None)
            elif slot.member is not None:
                folder = where / "model"
                if slot.base == "split":
                    assert gguf is not None
                    _link_or_copy(gguf, folder / "m-00001-of-00002.gguf")
                else:
                    for src in bases[slot.base].rglob("*"):
                        if src.is_file() and src.name not in slot.remove:
                            _link_or_copy(src, folder / src.relative_to(bases[slot.base]))
                target = folder / slot.member
                if target.exists():
                    target.unlink()
                made = make_special(special, target, slot.kind)
                if made != str(target):  # /dev/zero, /dev/null: a link to it under the member's name
                    target.symlink_to(made)
                fields["DIR"], path = str(folder), str(target)
            else:
                fields["DIR"] = str(bases["tiny"])
                fields["FILE"] = path = make_special(special, where / "input", slot.kind)
            argv = [slot.prog, *(arg.format(**fields) for arg in slot.argv)]
            says = SPECIALS[special][2 if slot.kind is DIRECTORY else 1]
            assert says is not None
            if special == "too-large":
                assert slot.kind is not None and slot.kind.max_bytes is not None
                says = f"{slot.kind.name} {says} {size_text(slot.kind.max_bytes)}"
            out.append(Case(name, slot, argv, path, (path, says) + ((slot.flag,) if slot.flag else ())))
    return out


def case_key(case: Case) -> str:
    """The runner's name of a case: its command line as JSON (fuzz_gguf's tool ``cli``)."""
    return json.dumps(case.argv)


def outcome(case: Case, result: dict) -> str:
    """clean, or what went wrong: signal | hang | traceback | wrong-status | multiline | unnamed."""
    if "signal" in result or "hang" in result:
        return "signal" if "signal" in result else "hang"
    if result.get("rc") == "exception":
        return "traceback"
    if result.get("rc") != 2:
        return "wrong-status"
    lines = result["stderr"].strip().splitlines()
    if len(lines) != 1 or not lines[0].startswith(f"{case.argv[0]}: error: "):
        return "multiline"
    return "clean" if all(e in lines[0] for e in case.expect) else "unnamed"
