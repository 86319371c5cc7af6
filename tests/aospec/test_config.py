from dataclasses import dataclass
from typing import Literal

import pytest

from aospec.config import from_mapping
from aospec.errors import ConfigError


@dataclass(frozen=True)
class Example:
    width: int = 8
    tpot_ms: float = 10.0
    rank: Literal["evd", "likelihood"] = "evd"
    name: str | None = None
    tpots: tuple[float, ...] = (20.0, 1.0)


def test_known_keys_build_the_record():
    cfg = from_mapping(Example, {"width": 3, "tpot_ms": 1, "rank": "likelihood", "tpots": [5, 1]})
    assert cfg == Example(width=3, tpot_ms=1, rank="likelihood", tpots=(5, 1))


def test_unknown_key_is_rejected_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown key 'widht'.*did you mean 'width'"):
        from_mapping(Example, {"widht": 3}, where="engine")


def test_unknown_key_without_close_match_lists_known_keys():
    with pytest.raises(ConfigError, match=r"known keys: name, rank, tpot_ms, tpots, width"):
        from_mapping(Example, {"zzzzzz": 1})


@pytest.mark.parametrize(
    ("key", "value"),
    [("width", "8"), ("width", True), ("tpot_ms", "fast"), ("rank", "random"), ("name", 3)],
)
def test_ill_typed_values_are_rejected_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=repr(key)):
        from_mapping(Example, {key: value})


def test_non_mapping_is_rejected():
    with pytest.raises(ConfigError, match="expected a mapping"):
        from_mapping(Example, ["width"])  # type: ignore[arg-type]
