"""Optional canonicalisation of inconsequential fields for draft acceptance."""

from __future__ import annotations

import pytest
from aospec.drafters.canonicalize import DEFAULT_FIELDS, FIELDS, Canonicalizer, canonicalizer
from hypothesis import given
from hypothesis import strategies as st

from aospec.errors import ConfigError


def test_off_by_default_and_parsed_from_config_values() -> None:
    assert canonicalizer(None) is None and canonicalizer(False) is None and canonicalizer("off") is None
    assert canonicalizer(True).fields == DEFAULT_FIELDS
    assert canonicalizer("times,pids").fields == ("pids", "times")
    assert canonicalizer(["durations"]).fields == ("durations",)
    assert canonicalizer("pids+times").fields == ("pids", "times")  # "+" fits inside a policy spec
    assert canonicalizer("all").fields == FIELDS
    with pytest.raises(ConfigError, match="unknown canonicalisation field"):
        canonicalizer("pids,colour")
    assert set(FIELDS) == {"pids", "temp_names", "times", "durations"}


@pytest.mark.parametrize(
    ("field", "a", "b"),
    [
        ("pids", "started server, pid 4242", "started server, pid 977"),
        ("pids", "[1] 12345\n", "[1] 888\n"),
        ("pids", "PID: 31", "PID: 4000"),
        ("temp_names", "wrote /tmp/tmpa8f3k2_x/out.txt", "wrote /tmp/tmpq0zz81lm/out.txt"),
        ("temp_names", "created tmp.Ab12Cd34Ef", "created tmp.Zz99Yy88Xx"),
        ("times", "2025-08-08T08:11:27.805162+00:00 start", "2025-08-09T01:02:03.000001+00:00 start"),
        ("times", "-rw-r--r-- 1 root root 4096 Mar 28 04:43 a", "-rw-r--r-- 1 root root 4096 Aug  8 08:11 a"),
        ("times", "at 12:01:59 ok", "at 07:00:00 ok"),
        ("durations", "Ran 3 tests in 0.53s", "Ran 3 tests in 1.2s"),
        ("durations", "real\t0m1.204s", "real\t0m0.003s"),
    ],
)
def test_each_field_makes_variants_equivalent(field: str, a: str, b: str) -> None:
    assert Canonicalizer([field]).equivalent(a, b)
    others = [f for f in FIELDS if f != field]
    assert not Canonicalizer(others).equivalent(a, b)


def test_consequential_differences_still_differ() -> None:
    c = Canonicalizer(FIELDS)
    assert not c.equivalent("<returncode>0</returncode>", "<returncode>1</returncode>")
    assert not c.equivalent("3 passed", "2 passed, 1 failed")
    assert not c.equivalent("size 4096", "size 8192")
    assert not Canonicalizer().equivalent("Ran in 0.5s", "Ran in 0.7s")  # durations are opt-in


@given(st.text(max_size=300))
def test_canonical_form_is_idempotent_and_identity_is_equivalent(text: str) -> None:
    c = Canonicalizer(FIELDS)
    once = c.canonical(text)
    assert c.canonical(once) == once
    assert c.equivalent(text, text)
