"""Recursive parsers fed user text, nested from below their limit to 1,000,000 deep (docs/decoding.md, "Limits of
what is parsed"): llama.cpp's GBNF parser and left-recursion search (patch grammar-nesting-limit), the JSON-schema
reader and converter (patch json-schema-depth-limit), and llama.cpp's Jinja parser for chat templates (patch
jinja-parser-nesting-limit), which `clover-cpp chat` and `clover-cpp serve` both render with (common/chat).

Each depth either works or is refused with an error naming the limit: never a signal, a hang or a traceback. The
native cases run in one probe subprocess that announces each case before it starts, so a stack overflow fails the
case it happened in instead of the test run. The server's side (a 400 for each) is tests/surfaces/test_serve_fuzz.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from clover_dev import REPO_ROOT
from tests.support.native import native_tool

GBNF_LIMIT = 1000  # LLAMA_GRAMMAR_MAX_NESTING (src/llama-grammar.h)
SCHEMA_LIMIT = 256  # COMMON_JSON_SCHEMA_MAX_DEPTH (common/json-schema.h)
DEPTHS = (10, 999, 1000, 1001, 20_000, 1_000_000)
SCHEMA_DEPTHS = (10, 120, 127, 128, 255, 256, 257, 1_000_000)
TIMEOUT_S = 120

# The probe: loads the GGUF once, then runs each case (`start NAME`, then a JSON line with the outcome).
PROBE = textwrap.dedent("""\
    import json, sys
    from clover_common.errors import BadInput
    from clover_cpp.chat_format import ChatTemplates
    from clover_cpp.model import Model
    from clover_native import libclover

    def gbnf_nested(n):
        return "root ::= " + "(" * n + '"a"' + ")" * n

    def gbnf_chain(n):  # r0 ::= r1, r1 ::= r2, ...: a left-recursion search as deep as the chain
        return "root ::= r0\\n" + "".join(f"r{i} ::= r{i + 1}\\n" for i in range(n)) + f'r{n} ::= "a"\\n'

    def gbnf_doubled(n):  # ambiguous: 2^n distinct parse stacks (and exponential for a search that revisits rules)
        rules = "".join(f"r{i} ::= r{i + 1} | r{i + 1} \\"b\\"\\n" for i in range(n))
        return "root ::= r0\\n" + rules + f'r{n} ::= "a"\\n'

    def gbnf_nontail(n):  # r0 ::= r1 "a", ...: one parse stack as deep as the chain
        return "root ::= r0\\n" + "".join(f'r{i} ::= r{i + 1} "a"\\n' for i in range(n)) + f'r{n} ::= "a"\\n'

    def gbnf_later(n):  # 32 "a" first, longer than a token: the stacks grow past the limit at a later token
        return 'root ::= "' + "a" * 32 + '" r0\\n' + gbnf_doubled(n).split("\\n", 1)[1]

    def schema(kind, n):
        if kind == "properties":
            return '{"type": "object", "properties": {"a": ' * n + '{"type": "string"}' + "}}" * n
        if kind == "items":
            return '{"type": "array", "items": ' * n + '{"type": "string"}' + "}" * n
        if kind == "anyOf":
            return '{"anyOf": [' * n + '{"type": "string"}' + "]}" * n
        if kind == "const":
            return '{"const": ' + "[" * n + "]" * n + "}"
        defs = ", ".join(f'"d{i}": {{"$ref": "#/$defs/d{i + 1}"}}' for i in range(n))
        return '{"$defs": {' + defs + f', "d{n}": {{"type": "string"}}}}, "$ref": "#/$defs/d0"}}'

    model = Model(sys.argv[1], n_ctx=64, n_threads=1)
    for line in sys.stdin:
        case = json.loads(line)
        print("start " + case["name"], flush=True)
        try:
            if case["what"] == "generate":
                grammar = globals()["gbnf_" + case["kind"]](case["n"])
                model.check_grammar(grammar)  # its start is fine
                try:
                    model.run("x", max_tokens=64, mode="ar", grammar=grammar)
                    out = {"ok": True}
                except Exception as exc:  # the call fails, with the grammar's reason
                    out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                out["after"] = len(model.run("x", max_tokens=2, mode="ar").tokens)  # the engine still answers
                print(json.dumps({"name": case["name"], **out}), flush=True)
                continue
            if case["what"] == "template":
                n = case["n"]
                source = {"parens": "{{ " + "(" * n + "1" + ")" * n + " }}",
                          "if": "{% if true %}" * n + "x" + "{% endif %}" * n,
                          "for": "{% for i in [1] %}" * n + "x" + "{% endfor %}" * n,
                          "list": "{{ " + "[" * n + "]" * n + " }}",
                          "filter": "{{ 'a'" + "|upper" * n + " }}",
                          "sum": "{{ 1" + " + 1" * n + " }}",
                          "macro": "{% macro m() %}" * n + "x" + "{% endmacro %}" * n}[case["kind"]]
                ChatTemplates(None, source, "nested.jinja").render([{"role": "user", "content": "hi"}])
            elif case["what"] == "gbnf":
                model.check_grammar(globals()["gbnf_" + case["kind"]](case["n"]))
            else:
                libclover.json_schema_to_grammar(case.get("text") or schema(case["kind"], case["n"]))
            out = {"ok": True}
        except (BadInput, libclover.NativeError) as exc:
            out = {"ok": False, "error": str(exc)}
        print(json.dumps({"name": case["name"], **out}), flush=True)
    """)


def _probe(gguf: Path, cases: list[dict]) -> dict[str, dict]:
    """Each case's outcome: {"ok": bool, "error": str}, or {"died": how} for the one that killed the probe (the
    cases after it are not run)."""
    proc = subprocess.run([sys.executable, "-c", PROBE, str(gguf)], input="".join(json.dumps(c) + "\n" for c in cases),
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO_ROOT)
    results: dict[str, dict] = {}
    current = None
    for line in proc.stdout.splitlines():
        if line.startswith("start "):
            current = line[6:]
        elif line.startswith("{"):
            res = json.loads(line)
            results[res.pop("name")] = res
            current = None
    if current is not None:
        results[current] = {"died": f"exit {proc.returncode}", "stderr": proc.stderr[-500:]}
    return results


@pytest.mark.native
def test_gbnf_nesting_is_refused_past_the_limit(demo_gguf: Path) -> None:
    """Nested groups load up to the limit and are refused past it, naming it; a chain of tail references as long as
    the grammar loads (the left-recursion search keeps its own stack); a grammar whose parse stacks expand past
    their limit (ambiguous, or a deep chain of non-tail references) is refused at once, at its start or mid-answer,
    where the engine survives the failed call; left recursion is still refused."""
    cases = [{"name": f"nested-{n}", "what": "gbnf", "kind": "nested", "n": n} for n in DEPTHS]
    cases += [{"name": "chain-200000", "what": "gbnf", "kind": "chain", "n": 200_000},
              {"name": "doubled-64", "what": "gbnf", "kind": "doubled", "n": 64},
              {"name": "nontail-20000", "what": "gbnf", "kind": "nontail", "n": 20_000},
              {"name": "nontail-500", "what": "gbnf", "kind": "nontail", "n": 500},
              {"name": "later-64", "what": "generate", "kind": "later", "n": 64}]
    t0 = time.monotonic()
    results = _probe(demo_gguf, cases)
    for n in DEPTHS:
        res = results.get(f"nested-{n}")
        assert res is not None and "died" not in res, (n, res)
        if n <= GBNF_LIMIT:
            assert res["ok"], (n, res)
        else:
            assert not res["ok"] and f"more than {GBNF_LIMIT} levels deep (the limit)" in res["error"], (n, res)
            assert "\n" not in res["error"] and len(res["error"]) < 300, res["error"]
    assert results["chain-200000"] == {"ok": True}, results["chain-200000"]
    assert results["nontail-500"] == {"ok": True}, results["nontail-500"]
    for name in ("doubled-64", "nontail-20000"):  # 2^64 stacks; 20,000 stacks of up to 20,000 elements
        assert not results[name]["ok"] and "parse stacks" in results[name]["error"], (name, results[name])
    later = results["later-64"]  # refused mid-answer: the call fails, the engine goes on
    assert not later["ok"] and "parse stacks" in later["error"] and later["after"] > 0, later
    assert time.monotonic() - t0 < TIMEOUT_S / 2

    from clover_common.errors import BadInput
    from clover_cpp.model import Model

    with Model(str(demo_gguf), n_ctx=64, n_threads=1) as model:
        # direct, indirect, and through a rule that may be empty
        for grammar in ('root ::= root "a" | "a"', 'root ::= x\nx ::= y "a"\ny ::= x | "b"',
                        'root ::= e x\ne ::= "" | "c"\nx ::= root "a" | "a"'):
            with pytest.raises(BadInput, match="rejected"):
                model.check_grammar(grammar)


@pytest.mark.native
def test_json_schema_nesting_is_refused_past_the_limit(demo_gguf: Path) -> None:
    """Schemas nested through properties, items, anyOf, a $ref chain and a const value, up to 1,000,000 deep as
    text (parsed by llama.cpp's JSON reader, not Python's): converted up to the limit, refused past it."""
    kinds = ("properties", "items", "anyOf", "ref", "const")
    depths = {k: SCHEMA_DEPTHS if k != "ref" else SCHEMA_DEPTHS[:-1] + (1000,) for k in kinds}  # a $def a level
    cases = [{"name": f"{k}-{n}", "what": "schema", "kind": k, "n": n} for k in kinds for n in depths[k]]
    long_name = '{"type": "object", "properties": {"' + "!" * 1_000_000 + '": {"type": "string"}}}'
    level = '{"type": "object", "properties": {"' + "x" * 100_000 + '": '
    long_names = level * 100 + '{"type": "string"}' + "}}" * 100

    def wide(n_keys: int) -> str:
        return '{"type": "object", "properties": {' + ", ".join(f'"p{i}": {{}}' for i in range(n_keys)) + "}}"

    cases += [{"name": "name-1000000", "what": "schema", "text": long_name},
              {"name": "names-100x100000", "what": "schema", "text": long_names},
              {"name": "keys-1024", "what": "schema", "text": wide(1024)},
              {"name": "keys-1000000", "what": "schema", "text": wide(1_000_000)}]
    results = _probe(demo_gguf, cases)
    for k in kinds:
        for n in depths[k]:
            res = results.get(f"{k}-{n}")
            assert res is not None and "died" not in res, (k, n, res)
            json_depth = {"properties": 2 * n + 1, "items": n + 1, "anyOf": 2 * n + 1, "ref": 3,
                          "const": n + 1}[k]  # the document's arrays and objects
            schema_depth = n + 2 if k == "ref" else n + 1  # the root, then a schema a level (the root is a $ref)
            if json_depth <= SCHEMA_LIMIT and schema_depth <= SCHEMA_LIMIT:
                assert res["ok"], (k, n, res)
            else:
                assert not res["ok"] and f"more than {SCHEMA_LIMIT} levels deep" in res["error"], (k, n, res)
                assert "\n" not in res["error"], res["error"]
    assert results["name-1000000"] == {"ok": True}, results["name-1000000"]  # no regex recursion per character
    assert results["names-100x100000"] == {"ok": True}, results["names-100x100000"]  # names cut, not multiplied
    assert results["keys-1024"] == {"ok": True}, results["keys-1024"]
    # an object's keys are found by a linear search when parsed: a million would take minutes
    assert not results["keys-1000000"]["ok"] and "more than 1024 keys" in results["keys-1000000"]["error"]


@pytest.mark.native
def test_the_clis_refuse_a_deep_grammar_with_one_line(demo_gguf: Path, tmp_path: Path) -> None:
    """`clover-cpp generate --grammar-file`, `-jf` and `llama-clover --grammar-file` on a 1,000,000-deep grammar and
    schema: exit 2 and one line naming the limit (they crashed with SIGSEGV before the limit)."""
    grammar = tmp_path / "deep.gbnf"
    grammar.write_text("root ::= " + "(" * 1_000_000 + '"a"' + ")" * 1_000_000 + "\n")
    schema = tmp_path / "deep.json"
    schema.write_text('{"type": "array", "items": ' * 100_000 + "{}" + "}" * 100_000)
    clover_cpp = Path(sys.executable).parent / "clover-cpp"
    common = ["-m", str(demo_gguf), "-p", "x", "-n", "2", "-t", "1"]
    for argv, prog, limit in (
            ([str(clover_cpp), "generate", *common, "--grammar-file", str(grammar)], "clover-cpp", GBNF_LIMIT),
            ([str(clover_cpp), "generate", *common, "-jf", str(schema)], "clover-cpp", SCHEMA_LIMIT),
            ([str(native_tool("llama-clover")), *common, "--grammar-file", str(grammar)], "", GBNF_LIMIT)):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (argv[1], done.returncode, done.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: " if prog else "error: "), done.stderr[-2000:]
        assert f"more than {limit} levels deep" in lines[0], lines[0]
        assert not done.stdout


TEMPLATE_LIMIT = 256  # JINJA_MAX_NESTING (common/jinja/parser.h)


@pytest.mark.native
def test_a_deeply_nested_chat_template_is_refused(demo_gguf: Path) -> None:
    """Chat templates nested 10 to 100,000 deep in seven ways (brackets, blocks, loops, lists, a chain of filters or
    of additions, macro definitions), rendered through common/chat as chat and serve do: the shallow ones render,
    the deep ones are refused with one line naming the limit; none crashes the process (they overflowed the stack
    before the limit)."""
    kinds = ("parens", "if", "for", "list", "filter", "sum", "macro")
    depths = (10, 100, 1000, 100_000)
    results = _probe(demo_gguf, [{"name": f"{k}-{n}", "what": "template", "kind": k, "n": n}
                                 for k in kinds for n in depths])
    for k in kinds:
        for n in depths:
            res = results.get(f"{k}-{n}")
            assert res is not None and "died" not in res, (k, n, res)
            if n < TEMPLATE_LIMIT:
                assert res["ok"], (k, n, res)
            else:
                assert not res["ok"] and f"nests deeper than {TEMPLATE_LIMIT} levels" in res["error"], (k, n, res)
                assert "\n" not in res["error"] and len(res["error"]) < 1000, res["error"]
