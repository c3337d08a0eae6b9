"""The one table of the generation parameters (GenParams' field metadata): the CLI and GenParams accept the values
the table's bounds allow, and every flag of the table is an option of generate. (`clover-cpp serve` is llama-server:
its request fields are checked by its own schema, tests/native/test_server_diffusion.py and test_server_sampling.py.)"""

from __future__ import annotations

import argparse
import math
import re

import pytest

from clover_common.errors import BadInput

from clover_cpp import options
from clover_cpp.gen_params import PARAMS, GenParamError, GenParams

PROBES = (-3.0, -1.0, 0.0, 1e-6, 0.5, 1.0, 1.5, 2.5, 50.0,
          # the engine's 32-bit types: the largest int32 and float32, and beyond (Bound.fits)
          2.0**31 - 1, 2.0**31, 2.0**63, 3.4028234663852886e38, 1e39, -1e39, 1e308, -1e308)
REQUEST_FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repeat_penalty",
                  "block_size", "threshold", "coreset_top_p")


def _integer(name: str) -> bool:
    return str(GenParams.__dataclass_fields__[name].type).startswith("int")


@pytest.mark.parametrize("name", REQUEST_FIELDS)
def test_gen_params_accept_what_the_table_allows(name: str) -> None:
    for probe in PROBES:
        value = int(probe) if _integer(name) else probe
        if _integer(name) and value != probe:
            continue
        try:
            GenParams(**{name: value})
            engine_ok = True
        except GenParamError:
            engine_ok = False
        assert engine_ok == PARAMS[name].bound.ok(value), (name, value)


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


@pytest.mark.parametrize("name,value,refused", [
    ("max_tokens", 2**31 - 1, None), ("max_tokens", 10**12, "at most 2147483647 (the engine's 32-bit integer)"),
    ("top_k", 2**63, "at most 2147483647"), ("block_size", 10**400, "got an integer of 401 digits"),
    ("temperature", 3.4028234663852886e38, None), ("temperature", 1e39, "(the engine's 32-bit float), got 1e+39"),
    ("frequency_penalty", -1e308, "at most 3.40282e+38 in magnitude"), ("repeat_penalty", math.inf, "> 0"),
])
def test_a_value_the_engines_field_cannot_hold_is_refused(name: str, value: float, refused: str | None) -> None:
    """The engine holds these in 32-bit ints and floats: 10^12 tokens would wrap negative, 1e39 become inf."""
    if refused is None:
        assert getattr(GenParams(**{name: value}), name) == value
        return
    with pytest.raises(GenParamError, match=re.escape(refused)):
        GenParams(**{name: value})


def test_the_command_line_refuses_what_would_wrap() -> None:
    p = argparse.ArgumentParser()
    options.add_generation_args(p, max_tokens=8, max_tokens_help="", seed=None, distribution=True)
    for argv, message in ((["-n", str(10**12)], "-n/--max-tokens must be at most 2147483647"),
                          (["--top-k", str(2**32)], "--top-k must be at most 2147483647"),
                          (["--temp", "1e39"], "--temp must be at most 3.40282e+38 in magnitude"),
                          (["--frequency-penalty=-1e300"], "--frequency-penalty must be at most")):
        with pytest.raises(BadInput, match=re.escape(message)):
            options.gen_params(p.parse_args(argv))
