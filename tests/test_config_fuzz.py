"""Property-based fuzzing of every way input reaches a job: config values, `--set` strings and fault specs.

The property: an input either loads and passes the job check that
`elastic run` does (`check_job`), or fails with a `ConfigError` of one line
that starts with the field it is about (or the `--set`/`--inject` it came
from). Never another exception: that would be a traceback or exit 1 at the
CLI. Derandomized, so a run is reproducible, and a few seconds long.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from elastic.config import ConfigError, JobConfig, load_config
from elastic.faults import KEYS, FaultSpecError, parse_faults
from elastic.preflight import check_job

DEMO = str(Path(__file__).resolve().parents[1] / "deploy" / "examples" / "demo.yaml")
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


def _names() -> list[str]:
    """Every section and every dotted field of the job config."""
    out = []
    for name, info in JobConfig.model_fields.items():
        out.append(name)
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            out += [f"{name}.{sub}" for sub in info.annotation.model_fields]
    return out


NAMES = _names()
LEAVES = [n for n in NAMES if "." in n or n not in {"model", "data", "parallel", "scaling", "training", "checkpoint", "fault"}]
JUNK_KEYS = st.from_regex(r"[a-z_]{1,9}(\.[a-z_]{1,9})?", fullmatch=True)
KEY = st.one_of(st.sampled_from(LEAVES), JUNK_KEYS)

INTS = st.one_of(st.integers(-3, 70), st.sampled_from([0, 1 << 27, (1 << 27) + 1, 65536, 65537, 2**63 - 1, 2**63, -(2**63) - 1, 10**12]))
SPEC_VALUES = st.one_of(st.integers(-2, 320).map(str), st.sampled_from(["nan", "inf", "-1", "1.5", "5-5", "3-2", "0-400", "kill+node", "data",
                                                                       "collective", "1e3", "", "1;2", "x"]), st.text(max_size=6))
SPECS = st.one_of(
    st.builds(lambda kind, items: kind + ":" + ",".join(f"{k}={v}" for k, v in items),
              st.sampled_from([*KEYS, "kil", "", "random "]),
              st.lists(st.tuples(st.sampled_from(sorted({k for keys in KEYS.values() for k in keys} | {"cuont", "rank "})), SPEC_VALUES),
                       max_size=4)),
    st.text(max_size=25),
)
VALUES = st.one_of(
    st.none(), st.booleans(), INTS, st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-300, 0.001, 0.5, 2.0, 1e300, "1e-300", "1e3", "1e12", "2.5e1", "1.5e0", "-1e3", "0e99", "1e999999999", "auto", "cuda", "1f1b", "gpipe", "interleaved_1f1b", "runs", "/", "a\x00b",
                     "s3://bucket/x", "../x"]),
    st.text(max_size=12), st.lists(SPECS, max_size=3), st.dictionaries(st.text(max_size=4), INTS, max_size=2),
)


def _assert_names_a_field(message: str, *given: str) -> None:
    """One line whose first word is a config field or section, or one of `given` (the key or spec the input used)."""
    assert "\n" not in message, message
    if any(message.startswith(g) for g in given):
        return
    first = re.match(r"[\w.\-]*", message).group(0)
    prefixes = {".".join(g.split(".")[:n]) for g in given for n in range(1, g.count(".") + 2)}  # an unknown section of a key
    assert first in NAMES or first in prefixes, message


def _load_and_check(**kwargs) -> None:
    """Load and check; what is accepted has only finite floats and 64-bit integers (what the runtime can hold)."""
    cfg = load_config(**kwargs)
    check_job(cfg)
    for section in cfg.model_dump().values():
        for value in section.values() if isinstance(section, dict) else [section]:
            assert not isinstance(value, float) or math.isfinite(value), cfg
            assert not isinstance(value, int) or abs(value) < 2**63, cfg


@FUZZ
@given(st.dictionaries(KEY, VALUES, max_size=5))
def test_any_config_loads_or_names_the_field(values):
    data: dict = {}
    for dotted, value in values.items():
        *sections, leaf = dotted.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
        if isinstance(node, dict):  # a section given a scalar first: this key has nowhere to go
            node[leaf] = value
    try:
        _load_and_check(data=data)
    except ConfigError as exc:
        _assert_names_a_field(str(exc), *values)


@FUZZ
@given(KEY, st.one_of(st.text(max_size=30), VALUES.map(str), SPECS.map(lambda s: f"[{s!r}]")))
def test_any_set_value_loads_or_names_the_key(key, raw):
    try:
        _load_and_check(path=DEMO, overrides=[f"{key}={raw}"])
    except ConfigError as exc:
        _assert_names_a_field(str(exc), key, f"--set {key}")


@FUZZ
@given(SPECS)
def test_any_inject_spec_parses_or_names_the_spec(spec):
    try:
        parse_faults([spec], steps=300, max_world=4)
    except FaultSpecError as exc:
        assert str(exc).startswith(repr(spec)) and "\n" not in str(exc), str(exc)
    try:
        check_job(load_config(DEMO), [spec])
    except ConfigError as exc:
        assert str(exc).startswith(f"--inject {spec!r}") and "\n" not in str(exc), str(exc)
