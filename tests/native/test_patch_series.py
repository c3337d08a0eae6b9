"""The llama.cpp patch series (cpp_patch/patches/, docs/native.md "Changing a patch"): every patch has its header,
the series applies in order to the pristine vendored tree without fuzz, the upstream candidates apply to it alone,
and the tree the native build compiled is exactly the pristine tree plus the series."""

from __future__ import annotations

from pathlib import Path

import pytest


from clover_dev import REPO_ROOT
from scripts import patch_series

from clover_native import cpu, loader

UPSTREAM_CANDIDATES = {"ggml-cpu-amx-tile-config", "memory-recurrent-seq-cp-rollback", "model-load-hparams-errors",
                       "graph-cache", "grammar-parse-error-to-log", "delta-net-conv-snapshots-of-the-ubatch",
                       "grammar-nesting-limit", "json-schema-depth-limit", "vocab-duplicate-text-error",
                       "speculative-simple-flush-log", "speculative-simple-rs-rollback-checkpoint",
                       "server-spec-round-at-context-end",
                       "sampling-penalties-response-only",
                       "common-sampler-mask-token", "ggml-host-buffers-huge-pages", "server-json-errors-are-400",
                       "server-loopback-host-check", "arg-input-files-regular-and-capped",
                       "chat-tool-choice-required-is-a-call", "server-named-tool-choice",
                       "server-responses-function-call-arguments-done", "server-request-nesting-cap",
                       "server-malformed-requests-are-400", "server-logprobs-of-drafted-tokens",
                       "vendor-httplib-thread-pool-burst", "vendor-httplib-header-read-timeout",
                       "vendor-httplib-refuse-declared-oversize-body",
                       "server-http-errors-have-a-body", "jinja-macro-call-depth",
                       "jinja-parser-nesting-limit", "chat-template-parse-error-keeps-its-message",
                       "server-bad-command-line-exits-2", "server-process-start-time-is-unix-time",
                       "server-max-tokens-0-generates-nothing", "server-finished-stream-keeps-connection",
                       "grammar-utf8-well-formed", "server-result-wait-has-a-deadline",
                       "server-anthropic-error-body", "server-anthropic-thinking-switch",
                       "memory-recurrent-snapshots-follow-moved-state", "server-queue-worker-wakes-for-work",
                       "sampling-dist-skips-masked-candidates"}


@pytest.mark.native
def test_series_applies_and_matches_the_build() -> None:
    info = cpu.read_build_info(loader.lib_dir().parent)
    assert info, "build/native/BUILD_INFO missing (make native writes it)"
    pristine = Path(info["sdist"]) / "vendor" / "llama.cpp"
    built = Path(info["build_dir"]).parent / "src"
    touched = patch_series.check(pristine, built)
    assert "src/llama-memory-recurrent.cpp" in touched


def test_headers_and_standalone_patches() -> None:
    names = {}
    for p in patch_series.series():
        header, diff = patch_series.split_patch(p.read_text())
        subject, blank = header.splitlines()[:2]
        assert subject and not blank, f"{p.name}: a subject line, then a blank line"
        assert all(k in header for k in ("Why:", "What:", "Tested")), f"{p.name}: why, what and how it was tested"
        tr = patch_series.trailers(header)
        assert p.name.endswith(f"-{tr['patch-name']}.patch"), p.name
        names[tr["patch-name"]] = tr.get("standalone") == "yes"
    assert {n for n, alone in names.items() if alone} == UPSTREAM_CANDIDATES


def test_every_patch_has_its_row_in_the_docs() -> None:
    """docs/native.md's table lists each patch of the series once, in order, and calls the upstream candidates so."""
    doc = (REPO_ROOT / "docs" / "native.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `00")]
    listed = [row.split("`")[1] for row in rows]
    assert listed == [p.stem for p in patch_series.series()], "docs/native.md's patch table differs from the series"
    for row, stem in zip(rows, listed):
        assert ("**upstream candidate**" in row) == (stem.split("-", 1)[1] in UPSTREAM_CANDIDATES), row[:80]
