"""Properties of input checking, over generated inputs (hypothesis): a mesh string either
parses into a valid mesh or is a UsageError, never another exception; and a training command
line with random numbers in its numeric flags is either accepted by the config resolution and
check_choices or refused with one line (a UsageError, or argparse's exit 2), never anything
else, and what is accepted is in range."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spmd import train
from spmd.errors import UsageError
from spmd.parallel.mesh import AXIS_ALIASES, MESH_AXES, format_mesh, parse_mesh
from spmd.run import checks, config

SETTINGS = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# Mesh strings: items built from real and made-up axis names, separators and sizes, joined by
# commas (doubled, spaced) or other separators, and arbitrary text.
axis_names = st.one_of(st.sampled_from(sorted(AXIS_ALIASES)), st.text(max_size=4))
sizes = st.one_of(
    st.integers(-3, 20).map(str),
    st.sampled_from(["-1", "0", "1_6", "+2", " 2 ", "2.0", "", "x", "\u0662", "99999999999999"]),
    st.text(max_size=3),
)
items = st.builds(
    lambda name, eq, size: f"{name}{eq}{size}", axis_names, st.sampled_from(["=", "", ":"]), sizes
)
mesh_strings = st.one_of(
    st.builds(
        lambda parts, sep: sep.join(parts),
        st.lists(items, max_size=5),
        st.sampled_from([",", ",,", ", ", ";", " "]),
    ),
    st.text(max_size=20),
)


@SETTINGS
@given(mesh_strings)
def test_a_mesh_string_parses_into_a_valid_mesh_or_is_a_usage_error(spec):
    try:
        sizes = parse_mesh(spec)
    except UsageError as e:
        assert "\n" not in str(e) and str(e).startswith("--mesh ")
        return
    assert list(sizes) == list(MESH_AXES)
    assert all(type(s) is int and (s >= 1 or s == -1) for s in sizes.values())
    assert list(sizes.values()).count(-1) <= 1
    assert ",," not in spec and spec.strip() and not spec.strip().endswith(",")


@SETTINGS
@given(st.dictionaries(st.sampled_from(MESH_AXES), st.integers(1, 64), max_size=6))
def test_a_formatted_mesh_parses_back_to_itself(named):
    sizes = {**dict.fromkeys(MESH_AXES, 1), **named}
    assert parse_mesh(format_mesh(sizes)) == sizes


# Training flags and the numbers they are given: ints and floats of every size, NaN and the
# infinities, and text that is not a number. An int flag given a float is argparse's error.
INT_FLAGS = ("--steps", "--batch", "--warmup", "--seq-len", "--accum", "--eval-every", "--seed")
FLOAT_FLAGS = ("--lr", "--eval-fraction", "--grad-clip", "--beta2", "--bucket-mb")
FLOAT_FLAGS += ("--spike-threshold", "--rope-theta", "--comm-warn")
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "0x10", "1_000", "", "ten"]),
)
flags = st.dictionaries(st.sampled_from(INT_FLAGS + FLOAT_FLAGS), numbers, min_size=1, max_size=4)


def resolve_and_check(argv: list[str]) -> config.Config:
    """What spmd.train does with a command line before any device work."""
    cfg = config.Config.of(train.resolve_sections(argv))
    checks.check_choices(cfg)
    return cfg


@SETTINGS
@given(values=flags)
def test_numeric_flags_are_accepted_in_range_or_refused_in_one_line(values, capsys):
    argv = ["--model", "tiny"]
    for flag, value in values.items():
        argv += [flag, str(value)]
    try:
        cfg = resolve_and_check(argv)
    except UsageError as e:
        assert "\n" not in str(e) and str(e)
        return
    except SystemExit as exited:  # argparse: a value that is not of the flag's type
        assert exited.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        return
    assert cfg.run.steps >= 1 and cfg.run.batch >= 1 and cfg.run.seq_len >= 1
    assert cfg.optimizer.warmup >= 0 and 0 <= cfg.run.seed < 2**63
    assert 0 < cfg.optimizer.lr < math.inf and 0 <= cfg.optimizer.grad_clip < math.inf
    assert 0 <= cfg.data.eval_fraction < 1 and 0 <= cfg.optimizer.beta2 < 1
    assert 0 <= cfg.parallel.bucket_mb < math.inf and 0 < cfg.model.rope_theta < math.inf


@pytest.mark.parametrize("flag", INT_FLAGS + FLOAT_FLAGS)
def test_nan_and_infinity_are_refused_by_every_numeric_flag(flag, capsys):
    """The edges the random search may miss: NaN and both infinities, flag by flag."""
    for value in ("nan", "inf", "-inf"):
        try:
            resolve_and_check(["--model", "tiny", flag, value])
        except (UsageError, SystemExit):
            continue
        pytest.fail(f"{flag} {value} was accepted")
