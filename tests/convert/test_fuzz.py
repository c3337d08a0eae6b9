"""Fuzzing the inputs: seeded GGUF mutants (header, metadata values and types, tensor infos, counts, offsets,
random byte flips; tests/support/fuzz_gguf.py) through `clover-cpp generate` and `clover-quantize`, and checkpoint
mutants (tests/support/fuzz_checkpoint.py) through `clover-convert`.

Every mutant must end in exit status 2 with one line that names the key or tensor at fault: no signal, no hang,
no traceback, no file left behind. The mutants run in a runner subprocess, many to a process (a process per
mutant would cost a second of imports each); the runner announces each mutant before it starts, so a signal or a
hang is pinned on that mutant and the runner is restarted on the rest. A few mutants also run through the real
console scripts, to check that the one line is all they print.

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

from tests.support import fuzz_checkpoint
from tests.support import fuzz_gguf
from clover_dev.convert import clover_convert

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
def tiny_gguf(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return clover_convert(tiny_checkpoint, tmp_path_factory.mktemp("fuzz-base") / "tiny-f32.gguf", "f32")


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
    """clover-convert on broken checkpoints: one line naming the file and the field or tensor, no output."""
    root = tmp_path / "mutants"
    root.mkdir()
    items = []
    for seed in SEEDS:  # the seed picks the damaged tensors
        (root / f"s{seed}").mkdir()
        for m in fuzz_checkpoint.mutants(tiny_checkpoint, seed=seed):
            path = fuzz_checkpoint.materialize(tiny_checkpoint, m, root / f"s{seed}")
            items.append((f"s{seed}-{m.name}", m.expect, False, str(path)))
    assert len(items) >= 80
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
