"""The one table of the generation parameters (GenParams' field metadata): the server's request schema, the CLI
and GenParams accept the same values, and every flag of the table is an option of generate."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from clover_cpp import options
from clover_cpp.gen_params import PARAMS, GenParamError, GenParams
from clover_cpp.serve.schema import CompletionRequest

PROBES = (-3.0, -1.0, 0.0, 1e-6, 0.5, 1.0, 1.5, 2.5, 50.0)
REQUEST_FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repeat_penalty",
                  "block_size", "threshold", "coreset_top_p")


def _integer(name: str) -> bool:
    return str(GenParams.__dataclass_fields__[name].type).startswith("int")


@pytest.mark.parametrize("name", REQUEST_FIELDS)
def test_server_and_gen_params_accept_the_same_values(name: str) -> None:
    for probe in PROBES:
        value = int(probe) if _integer(name) else probe
        if _integer(name) and value != probe:
            continue
        try:
            GenParams(**{name: value})
            engine_ok = True
        except GenParamError:
            engine_ok = False
        try:
            CompletionRequest(model="m", prompt="x", **{name: value})
            server_ok = True
        except ValidationError:
            server_ok = False
        assert engine_ok == server_ok == PARAMS[name].bound.ok(value), (name, value)


def test_every_flag_of_the_table_is_an_option() -> None:
    p = argparse.ArgumentParser()
    options.add_generation_args(p, max_tokens=8, max_tokens_help="", seed=None, draft_steps=True, distribution=True)
    known = {s for a in p._actions for s in a.option_strings}
    for name, spec in PARAMS.items():
        assert set(spec.flags) <= known, name
    assert p.parse_args(["--temperature", "0.5", "--n-predict", "3", "-s", "4"]).temperature == 0.5


def test_a_bad_value_names_the_flag_and_its_range() -> None:
    p = argparse.ArgumentParser()
    options.add_generation_args(p, max_tokens=8, max_tokens_help="", seed=None)
    with pytest.raises(Exception, match=r"--coreset-top-p must be in \(0, 1\], got 0.0"):
        options.gen_params(p.parse_args(["--coreset-top-p", "0"]))


def test_a_bool_field_is_a_flag_pair() -> None:
    """spec_fused: --spec-fused / --no-spec-fused; left out, GenParams' default."""
    p = argparse.ArgumentParser()
    options.add_generation_args(p, max_tokens=8, max_tokens_help="", seed=None, draft_steps=True)
    assert options.gen_params(p.parse_args([])).spec_fused is GenParams().spec_fused is False
    assert options.gen_params(p.parse_args(["--spec-fused"])).spec_fused is True
    assert options.gen_params(p.parse_args(["--no-spec-fused"])).spec_fused is False
