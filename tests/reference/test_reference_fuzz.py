"""`clover-ref generate` on the numeric config mutants (tests/support/fuzz_checkpoint.py ``numeric_mutants``: the
numeric fields of config.json and generation_config.json with the edge values each refuses, top level and nested):
exit 2 and one line naming the file and the field, as clover-convert gives on every one of them
(tests/convert/test_fuzz.py). clover-ref reads the config through the same CloverConfig.load, so a seeded sample
runs here: one edge value for each field and placement. The mutants run in one runner process
(tests/support/fuzz_gguf.py), which imports torch once."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.support import fuzz_checkpoint, fuzz_gguf

TIMEOUT_S = 60  # per mutant: a hang


def test_numeric_edge_values_in_every_config_field(tiny_checkpoint: Path, tmp_path: Path, record_property) -> None:
    root = tmp_path / "mutants"
    root.mkdir()
    by_case: dict[str, list[fuzz_checkpoint.CheckpointMutant]] = {}
    for m in fuzz_checkpoint.numeric_mutants(tiny_checkpoint):
        by_case.setdefault(m.name.rsplit("-", 1)[0].removesuffix("-"), []).append(m)  # the name less its edge
    rng = random.Random(0)
    mutants = [rng.choice(group) for _, group in sorted(by_case.items())]
    assert len(mutants) > 100
    commands = {}
    for m in mutants:
        model = fuzz_checkpoint.materialize(tiny_checkpoint, m, root)
        commands[m.name] = json.dumps(["clover-ref", "generate", str(model), "-p", "x", "--mode", "ar", "-n", "1"])
    results = fuzz_gguf.run_mutants("cli", list(commands.values()), tmp_path, TIMEOUT_S)
    bad = []
    for m in mutants:
        res = results[commands[m.name]]
        lines = res.get("stderr", "").strip().splitlines()
        file = "generation_config.json" if "-generation-" in m.name or "-in-generation-" in m.name else "config.json"
        if not (res.get("rc") == 2 and len(lines) == 1 and lines[0].startswith("clover-ref: error: ")
                and f"/{m.name}/{file}: field '" in lines[0] and any(e in lines[0] for e in m.expect)):
            bad.append(f"{m.name}: {str(res)[:300]}")
    record_property("note", f"clover-ref on numeric config mutants: {len(mutants)} tried, {len(bad)} not a clean "
                            "one-line error")
    assert not bad, "\n".join(bad[:40])
