"""Fuzzing the inputs: seeded GGUF mutants (header, metadata values and types, tensor infos, counts, offsets,
random byte flips; tests/support/fuzz_gguf.py) through `clover-cpp generate` and `clover-quantize`, and checkpoint
mutants (tests/support/fuzz_checkpoint.py) through `clover-convert`.

Every mutant must end in exit status 2 with one line that names the key or tensor at fault: no signal, no hang,
no traceback, no file left behind. The mutants run in a runner subprocess, many to a process (a process per
mutant would cost a second of imports each); the runner announces each mutant before it starts, so a signal or a
hang is pinned on that mutant and the runner is restarted on the rest. A few mutants also run through the real
console scripts, to check that the one line is all they print.

Special files (a fifo, /dev/zero, a directory, a link that leads nowhere, a file over its kind's size cap) go into
every file option of every tool (tests/support/fuzz_files.py): one line naming the path, what it is and the
option, within a bounded time and memory.

CLOVER_FUZZ=full runs the larger set: more random flips over three seeds, and every GGUF mutant through
clover-quantize (the default sends a seeded sample). The counts go to the run's notes."""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from clover_ref.factory import init_checkpoint
from tests.support import fuzz_checkpoint
from tests.support import fuzz_files
from tests.support import fuzz_gguf
from clover_dev.convert import clover_convert
from tests.support.tmp import MkTemp

FULL = os.environ.get("CLOVER_FUZZ") == "full"
SEEDS = (0, 1, 2) if FULL else (0,)
N_RANDOM = 200 if FULL else 40
QUANTIZE_SAMPLE = None if FULL else 80  # GGUF mutants sent through clover-quantize
TIMEOUT_S = 60  # per mutant: a hang
VENV_BIN = Path(sys.executable).parent


# The fields a random byte flip may change and still load, each for a reason: any value is valid (token texts,
# merges and types, the chat template, general.* descriptions, thresholds and rope/eps values that stay in
# range, a nonzero bool) or llama.cpp ignores it (an out-of-range eos/padding id, with a warning).
FREE_FIELDS = ("kv tokenizer.ggml.tokens", "kv tokenizer.ggml.merges", "kv tokenizer.ggml.token_type",
               "kv tokenizer.chat_template", "kv general.", "kv tokenizer.ggml.eos_token_id",
               "kv tokenizer.ggml.padding_token_id", "kv tokenizer.ggml.add_", "kv tokenizer.ggml.mask_token_id",
               "kv clover_moe.attention.recurrent_layers", "kv clover_moe.rope.freq_base",
               "kv clover_moe.attention.layer_norm_rms_epsilon", "kv clover_moe.diffusion.",
               "kv clover_moe.context_length", "kv clover_moe.bd.", "kv diffusion.shift_logits")


def _classify(m_expect: tuple[str, ...], may_load: bool, res: dict, prog: str) -> str:
    """signal | hang | traceback | wrong-success | loads (a may_load mutant that loaded) | multiline | unnamed |
    wrong-status | clean"""
    if "signal" in res:
        return "signal"
    if "hang" in res:
        return "hang"
    if res.get("rc") == "exception":
        return "traceback"
    if res.get("rc") == 0:
        return "loads" if may_load else "wrong-success"
    if res.get("rc") != 2:
        return "wrong-status"
    lines = res["stderr"].strip().splitlines()
    if len(lines) != 1 or not lines[0].startswith(f"{prog}: error: "):
        return "multiline"
    if m_expect and not any(e.lower() in lines[0].lower() for e in m_expect):
        return "unnamed"
    if "see llama.cpp's log" in lines[0] or "missing or not a GGUF" in lines[0]:  # the reason, not a pointer to it
        return "unnamed"
    return "clean"


def _report(kind: str, items: list[tuple[str, tuple[str, ...], bool, str]], results: dict[str, dict], prog: str,
            record_property, notes: dict[str, str] | None = None) -> None:
    counts: collections.Counter[str] = collections.Counter()
    bad = []
    for name, expect, may_load, path in items:
        outcome = _classify(expect, may_load, results[path], prog)
        note = (notes or {}).get(name, "")
        if outcome == "loads" and note.startswith("bytes of "):  # a random flip: only where any value is valid
            fields = note[len("bytes of "):].split(", ")
            if not all(f.startswith(FREE_FIELDS) for f in fields):
                outcome = "wrong-success"
        counts[outcome] += 1
        if outcome not in ("clean", "loads"):
            bad.append(f"{name}: {outcome}: {note} {str(results[path])[:300]}")
    summary = (f"fuzz {kind}: {len(items)} tried, {counts['clean']} clean errors, {counts['loads']} harmless loads, "
               f"{counts['signal']} signals, {counts['hang']} hangs, {counts['wrong-success']} wrong successes, "
               f"{len(bad) - counts['signal'] - counts['hang'] - counts['wrong-success']} other")
    record_property("note", summary)
    assert not bad, summary + "\n" + "\n".join(bad[:40])


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    return clover_convert(tiny_checkpoint, module_tmp("fuzz-base") / "tiny-f32.gguf", "f32")


def _gguf_mutants(base: Path, root: Path) -> tuple[list[tuple[str, tuple[str, ...], bool, str]], dict[str, str]]:
    data = base.read_bytes()
    items = []
    notes = {}
    for seed in SEEDS:
        for m in fuzz_gguf.mutants(data, seed=seed, n_random=N_RANDOM):
            path = root / f"s{seed}-{m.name}.gguf"
            if not path.exists():
                path.write_bytes(m.data)
                items.append((f"s{seed}-{m.name}", m.expect, m.may_load, str(path)))
                notes[f"s{seed}-{m.name}"] = m.note
    return items, notes


def _dir_listing(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


@pytest.mark.native
def test_gguf_mutants_generate(tiny_gguf: Path, tmp_path: Path, record_property) -> None:
    """clover-cpp generate (load, then 4 tokens in auto mode) on every GGUF mutant."""
    root = tmp_path / "mutants"
    root.mkdir()
    items, notes = _gguf_mutants(tiny_gguf, root)
    assert len(items) >= 300
    before = _dir_listing(root)
    results = fuzz_gguf.run_mutants("generate", [p for *_, p in items], tmp_path, TIMEOUT_S, None)
    assert _dir_listing(root) == before  # generate writes nothing next to the model
    _report("clover-cpp generate on GGUF mutants", items, results, "clover-cpp", record_property, notes)


@pytest.mark.native
def test_gguf_mutants_quantize(tiny_gguf: Path, tmp_path: Path, record_property) -> None:
    """clover-quantize refuses what the engine refuses, and leaves no output or temporary file."""
    root = tmp_path / "mutants"
    root.mkdir()
    items, notes = _gguf_mutants(tiny_gguf, root)
    if QUANTIZE_SAMPLE is not None:
        items = random.Random(0).sample(items, QUANTIZE_SAMPLE)
    out = tmp_path / "out"
    out.mkdir()
    results = fuzz_gguf.run_mutants("quantize", [p for *_, p in items], out, TIMEOUT_S, None)
    loaded = {Path(p).stem + "-q8.gguf" for _, _, _, p in items if results[p].get("rc") == 0}
    assert _dir_listing(out) <= loaded, "files left behind: " + ", ".join(sorted(_dir_listing(out) - loaded))
    _report("clover-quantize on GGUF mutants", items, results, "clover-quantize", record_property, notes)


def test_checkpoint_mutants_convert(tiny_checkpoint: Path, tmp_path: Path, record_property) -> None:
    """clover-convert on broken checkpoints: one line naming the file and the field or tensor, no output. Most are
    the numeric edge values in every numeric config field (fuzz_checkpoint.numeric_mutants)."""
    root = tmp_path / "mutants"
    root.mkdir()
    items = []
    for seed in SEEDS:  # the seed picks the damaged tensors
        (root / f"s{seed}").mkdir()
        for m in fuzz_checkpoint.mutants(tiny_checkpoint, seed=seed):
            path = fuzz_checkpoint.materialize(tiny_checkpoint, m, root / f"s{seed}")
            items.append((f"s{seed}-{m.name}", m.expect, False, str(path)))
    assert len(items) >= 800
    out = tmp_path / "out"
    out.mkdir()
    results = fuzz_gguf.run_mutants("convert", [p for *_, p in items], out, TIMEOUT_S, None)
    assert not _dir_listing(out), "files left behind: " + ", ".join(sorted(_dir_listing(out)))
    _report("clover-convert on checkpoint mutants", items, results, "clover-convert", record_property)


# upstream llama.cpp's clover_moe checks (docs/gguf-format.md "Checks at load"): the line must name the key
UPSTREAM_CHECKS = {
    "kv-attention.recurrent_layers-0": "attention.recurrent_layers",  # every layer GDN
    "kv-attention.recurrent_layers-1": "attention.recurrent_layers",  # every layer full attention
    "kv-attention.value_length-1000": "attention.value_length",       # value head size != key head size
}


@pytest.mark.parametrize("name", ["truncate-200", "kv-expert_used_count-9", "f16-blk.0.ssm_a", *UPSTREAM_CHECKS])
@pytest.mark.native
def test_console_script_prints_one_line(tiny_gguf: Path, tmp_path: Path, name: str) -> None:
    """The real clover-cpp and clover-quantize print only their one line (llama.cpp's log stays quiet)."""
    m = next(m for m in fuzz_gguf.mutants(tiny_gguf.read_bytes(), seed=0, n_random=0) if m.name == name)
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(m.data)
    for cmd, prog in (([str(VENV_BIN / "clover-cpp"), "generate", "-m", str(path), "-p", "x", "-n", "2"], "clover-cpp"),
                      ([str(VENV_BIN / "clover-quantize"), str(path), str(tmp_path / "q.gguf"), "Q8_0"],
                       "clover-quantize")):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), proc.stderr
        assert any(e.lower() in lines[0].lower() for e in m.expect), lines[0]
        if prog == "clover-cpp" and name in UPSTREAM_CHECKS:
            assert f"clover_moe.{UPSTREAM_CHECKS[name]}" in lines[0] and str(path) in lines[0], lines[0]
        assert not proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


# ---------------------------------------------------------------------- special files in every file option
SPECIAL_TIMEOUT_S = 30  # per command line: a fifo waited on
SPECIAL_MAX_DATA = 4 * 2**30  # the runner's RLIMIT_DATA: /dev/zero read to its end fails at once, not after 30 s


@pytest.fixture(scope="module")
def special_bases(tiny_checkpoint: Path, module_tmp: MkTemp) -> dict[str, Path]:
    """The checkpoints whose files the cases replace: tiny, and tiny in five shards with an index."""
    sharded = module_tmp("fuzz-files-sharded")
    init_checkpoint(sharded, "tiny", seed=0, max_shard_bytes=300_000)
    assert (sharded / "model-00002-of-00005.safetensors").is_file()
    return {"tiny": tiny_checkpoint, "sharded": sharded}


def _special_files(tmp_path: Path, bases: dict[str, Path], gguf: Path | None, native: bool,
                   record_property) -> None:
    items = fuzz_files.cases(tmp_path / "cases", bases, gguf, native)
    slots = {c.slot for c in items}
    assert slots == {s for s in fuzz_files.SLOTS if s.native == native}  # every file option has cases
    assert all(sum(c.slot == s for c in items) >= 5 for s in slots)
    results = fuzz_gguf.run_mutants("cli", [fuzz_files.case_key(c) for c in items], tmp_path, SPECIAL_TIMEOUT_S,
                                    None, SPECIAL_MAX_DATA)
    outcomes = {c.name: fuzz_files.outcome(c, results[fuzz_files.case_key(c)]) for c in items}
    bad = [f"{c.name}: {outcomes[c.name]}: {str(results[fuzz_files.case_key(c)])[:300]}" for c in items
           if outcomes[c.name] != "clean"]
    left = sorted(str(p) for p in (tmp_path / "cases").rglob("out*"))
    tools = sorted({s.prog for s in slots})
    summary = (f"special files: {len(items)} command lines, {len(slots)} file options of {', '.join(tools)}: "
               f"{sum(o == 'clean' for o in outcomes.values())} clean one-line errors")
    record_property("note", summary)
    assert not bad and not left, summary + "\n" + "\n".join(bad[:40] + [f"left behind: {p}" for p in left])


def test_special_files_convert_ref(special_bases: dict[str, Path], tmp_path: Path, record_property) -> None:
    """clover-convert and clover-ref: every checkpoint file they read and every file option, as a fifo, /dev/zero,
    /dev/null, a directory, a link that leads nowhere or to a fifo, a sparse file over the cap, missing."""
    _special_files(tmp_path, special_bases, None, False, record_property)


@pytest.mark.native
def test_special_files_quantize_cpp(special_bases: dict[str, Path], tiny_gguf: Path, tmp_path: Path,
                                    record_property) -> None:
    """clover-quantize and clover-cpp generate, chat and imatrix: every file option, as above; serve: its model."""
    _special_files(tmp_path, special_bases, tiny_gguf, True, record_property)


# the console scripts themselves print only the one line (a sample: a fifo, /dev/zero, a too-large file)
SPECIAL_SCRIPT_CASES = ("clover-convert-model.safetensors-fifo", "clover-convert---metadata-dev-zero",
                        "clover-cpp-generate---grammar-file-fifo", "clover-cpp-serve--m_--model-dev-zero",
                        "clover-cpp-chat---chat-template-too-large", "clover-quantize-IN-fifo")


@pytest.mark.parametrize("name", SPECIAL_SCRIPT_CASES)
@pytest.mark.native
def test_special_files_console_scripts(special_bases: dict[str, Path], tiny_gguf: Path, tmp_path: Path,
                                       name: str) -> None:
    case = next(c for native in (False, True) for c in fuzz_files.cases(tmp_path / str(native), special_bases,
                                                                        tiny_gguf, native) if c.name == name)
    proc = subprocess.run([str(VENV_BIN / case.argv[0]), *case.argv[1:]], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=SPECIAL_TIMEOUT_S)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{case.argv[0]}: error: "), proc.stderr
    assert all(e in lines[0] for e in case.expect), (case.expect, lines[0])
    assert not proc.stdout


# llama-clover (C): its file options through cpp_patch/tools/clover/clover-input.h, one process per command line
# (it exits before loading anything). The too-large case: --grammar-file, whose cap is the grammar kind's.
LLAMA_CLOVER_SLOTS = (("-m", ("-m", "{FILE}", "-p", "x", "-n", "1")),
                      ("--bd", ("-m", "{GGUF}", "--bd", "{FILE}", "-p", "x", "-n", "1")),
                      ("--grammar-file", ("-m", "{GGUF}", "--grammar-file", "{FILE}", "-p", "x", "-n", "1")))


@pytest.mark.native
def test_special_files_llama_clover(tiny_gguf: Path, tmp_path: Path) -> None:
    """llama-clover's -m, --bd and --grammar-file as a fifo, /dev/zero, /dev/null, a directory, a link that leads
    nowhere or to a fifo, a file over the grammar cap, missing: exit 2 and one line that names the path and what it
    is, at once (a fifo would block llama.cpp's fopen)."""
    from clover_common.input_files import GRAMMAR
    from tests.support.native import native_tool

    tool = native_tool("llama-clover")
    bad = []
    for flag, argv in LLAMA_CLOVER_SLOTS:
        for special, (_, says, _) in fuzz_files.SPECIALS.items():
            if says is None or (special == "too-large" and flag != "--grammar-file"):
                continue
            path = fuzz_files.make_special(special, tmp_path / f"{flag.strip('-')}-{special}", GRAMMAR)
            says = "bytes allowed" if special == "too-large" else says
            done = subprocess.run([str(tool), *(a.format(FILE=path, GGUF=tiny_gguf) for a in argv)],
                                  capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=SPECIAL_TIMEOUT_S)
            lines = done.stderr.strip().splitlines()
            if not (done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ")
                    and path in lines[0] and says in lines[0]):
                bad.append(f"{flag} {special}: exit {done.returncode}: {done.stderr[-300:]}")
    assert not bad, "\n".join(bad)
