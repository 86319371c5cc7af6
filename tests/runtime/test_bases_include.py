"""``aospec sandbox build-base debootstrap --include PKG,...``: the package set names the
base (different sets never share a cache entry), reaches debootstrap's own ``--include``,
and ``debootstrap:SUITE+PKG,...`` opens it. A real debootstrap takes minutes and a mirror;
here a stub ``debootstrap`` on PATH records its arguments and writes a tiny tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from aospec.runtime.bases import build_base, debootstrap_name, open_base, parse_debootstrap_spec

from aospec.errors import SandboxError, SandboxUnavailableError

STUB = """#!/bin/sh
# records its arguments; the last non-option argument but one is the target
echo "$@" >> "$STUB_LOG"
for a in "$@"; do case "$a" in -*) ;; *) prev="$target"; target="$a";; esac; done
mkdir -p "$target/bin" && printf '#!/bin/sh\\n' > "$target/bin/sh" && chmod 755 "$target/bin/sh"
echo "$@" > "$target/args"
"""


@pytest.fixture
def stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "debootstrap").write_text(STUB)
    (bindir / "debootstrap").chmod(0o755)
    log = tmp_path / "log"
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STUB_LOG", str(log))
    monkeypatch.setenv("AOSPEC_CACHE_DIR", str(tmp_path / "cache"))
    return log


def test_spec_parsing_sorts_and_merges_packages() -> None:
    assert parse_debootstrap_spec("debootstrap") == ("bookworm", ())
    assert parse_debootstrap_spec("debootstrap:trixie") == ("trixie", ())
    assert parse_debootstrap_spec("debootstrap+make,gcc") == ("bookworm", ("gcc", "make"))
    assert parse_debootstrap_spec("debootstrap:bookworm+make", include="python3, gcc,make") == (
        "bookworm",
        ("gcc", "make", "python3"),
    )
    assert parse_debootstrap_spec("debootstrap", include=["g++", "libstdc++6"]) == ("bookworm", ("g++", "libstdc++6"))
    for bad in ("debootstrap+Bad_Name", "debootstrap+a;rm -rf /", "debootstrap:../x"):
        with pytest.raises(SandboxError):
            parse_debootstrap_spec(bad)


def test_names_reflect_the_package_set() -> None:
    assert debootstrap_name("bookworm") == "debootstrap-bookworm"
    a = debootstrap_name("bookworm", ("gcc", "make", "python3"))
    assert a.startswith("debootstrap-bookworm-with-gcc_make_python3-")
    names = {
        a,
        debootstrap_name("bookworm", ("gcc", "make")),
        debootstrap_name("trixie", ("gcc", "make", "python3")),
        debootstrap_name("bookworm", ("g++",)),
        debootstrap_name("bookworm", ("g",)),  # sanitised alike, told apart by the hash
    }
    assert len(names) == 5
    assert all(all(c.isalnum() or c in "._-" for c in n) for n in names)


def test_build_passes_include_and_caches_per_set(stub: Path) -> None:
    plain = build_base("debootstrap:bookworm")
    with_pkgs = build_base("debootstrap:bookworm", include="python3,make,gcc")
    same = build_base("debootstrap:bookworm+gcc,make,python3")  # cached: no second run
    other = build_base("debootstrap+make")
    calls = stub.read_text().splitlines()
    assert len(calls) == 3
    assert "--include" not in calls[0]
    assert "--include=gcc,make,python3" in calls[1].split()
    assert "--include=make" in calls[2].split()
    assert plain.name == "debootstrap-bookworm"
    assert same == with_pkgs and with_pkgs.name == debootstrap_name("bookworm", ("gcc", "make", "python3"))
    assert len({plain.path, with_pkgs.path, other.path}) == 3
    meta = json.loads((with_pkgs.path.parent / "base.json").read_text())
    assert meta["include"] == ["gcc", "make", "python3"] and meta["suite"] == "bookworm"
    assert open_base("debootstrap:bookworm+python3,gcc,make", build=False) == with_pkgs
    assert open_base("debootstrap", build=False) == plain
    with pytest.raises(SandboxUnavailableError, match="build-base debootstrap:bookworm\\+curl"):
        open_base("debootstrap:bookworm+curl", build=False)
    with pytest.raises(SandboxError, match="debootstrap bases only"):
        build_base("busybox", include="gcc")


def test_cli_include(stub: Path) -> None:
    args = ["sandbox", "build-base", "debootstrap:bookworm", "--include", "make,gcc", "--format", "json"]
    proc = subprocess.run(
        [sys.executable, "-m", "aospec", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["spec"] == "debootstrap:bookworm+gcc,make"
    assert out["name"] == debootstrap_name("bookworm", ("gcc", "make"))
    assert "--include=gcc,make" in stub.read_text().split()
