import pytest

from aospec._lazy import import_object, require
from aospec.errors import ConfigError, MissingDependencyError


def test_require_returns_an_installed_module():
    assert require("json", "dev").dumps([1]) == "[1]"


def test_require_names_the_extra_that_fixes_a_missing_module():
    with pytest.raises(MissingDependencyError, match=r"pip install 'aospec\[vllm\]'") as info:
        require("aospec_no_such_module_xyz", "vllm", purpose="in-process drafting")
    assert "in-process drafting" in str(info.value)
    assert isinstance(info.value, ImportError)


def test_import_object_resolves_short_names_and_dotted_paths():
    registry = {"dumps": "json:dumps"}
    import json

    assert import_object("dumps", registry, "thing") is json.dumps
    assert import_object("json.loads", registry, "thing") is json.loads
    assert import_object("json:JSONDecoder", registry, "thing") is json.JSONDecoder


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", r"unknown thing 'nope'; known: dumps"),
        ("no_such_pkg_xyz.mod:attr", r"module 'no_such_pkg_xyz.mod' not found"),
        ("json:no_such_attr", r"has no attribute 'no_such_attr'"),
    ],
)
def test_import_object_errors_are_clear(name, message):
    with pytest.raises(ConfigError, match=message):
        import_object(name, {"dumps": "json:dumps"}, "thing")
