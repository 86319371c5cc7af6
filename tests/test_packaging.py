"""Installed, aospec is one import name: the wheel holds ``aospec`` (with ``aospec.runtime``,
``aospec.drafters``, ...) and nothing else at the top of site-packages, so a user's own
``training/``, ``runtime/`` or ``integrations/`` folder does not shadow any part of it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("aospec", "runtime", "drafters", "replay", "training", "specbox", "live", "integrations")


def _source_copy(dest: Path) -> Path:
    """The tracked files of this checkout (or the tree, outside git) copied to ``dest``, so
    that building a wheel leaves no build/ or egg-info behind in the checkout."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode == 0 and listed.stdout:
        for rel in listed.stdout.decode().split("\0"):
            if rel and (ROOT / rel).is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, dest / rel)
    else:
        shutil.copytree(ROOT, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".venv", ".git", "build"))
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, unpacked as a site-packages directory would hold it."""
    src = _source_copy(tmp_path_factory.mktemp("src"))
    wheels = tmp_path_factory.mktemp("wheels")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w", str(wheels)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = wheels.glob("aospec-*.whl")
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


def test_the_wheel_puts_only_aospec_at_the_top_of_site_packages(installed: Path) -> None:
    top = sorted(p.name for p in installed.iterdir())
    assert [n for n in top if not n.endswith(".dist-info")] == ["aospec"]
    for pkg in FOLDERS[1:]:
        assert (installed / "aospec" / pkg / "__init__.py").is_file(), f"aospec.{pkg} is missing from the wheel"
    assert any((installed / "aospec" / "replay" / "data" / "tb1-sample").iterdir())  # the bundled traces


def test_every_package_folder_is_listed_for_the_wheel() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder in FOLDERS:
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).parts
            found.add(".".join(rel if folder == "aospec" else ("aospec", *rel)))
    assert found == listed


def test_a_project_with_its_own_training_runtime_and_integrations_folders_runs_aospec(
    installed: Path, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    for name in ("training", "runtime", "integrations", "replay", "live"):
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text("raise ImportError('the user project, not aospec')\n")
    # the unpacked wheel comes first on the path, as site-packages would, and the project's
    # folder is the working directory: `python -m` puts it at the front of sys.path
    env = dict(os.environ, PYTHONPATH=str(installed))

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *argv], cwd=project, env=env, capture_output=True, text=True, timeout=300
        )

    for verb in ("sandbox", "train", "sweep", "run", "mcp"):
        proc = run("-m", "aospec", verb, "--help")
        assert proc.returncode == 0, f"aospec {verb} --help: {proc.stderr[-2000:]}"
        assert "usage: aospec " + verb in proc.stdout
    proc = run(
        "-c",
        "import aospec.runtime, aospec.training, aospec.integrations.minisweagent as m; "
        "print(aospec.runtime.__file__); print(m.SpeculativeAgent.__module__)",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, module = proc.stdout.split()
    assert Path(where).is_relative_to(installed) and module == "aospec.integrations.minisweagent"
    proc = run("-m", "aospec", "traces", "stats", "--bundled", "--format", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]


def _requirements(dist: str, extras: frozenset[str] = frozenset()) -> list[str]:
    """The distributions ``dist`` requires (with ``extras``), by normalised name."""
    import re
    from importlib import metadata

    from packaging.requirements import Requirement

    out = []
    for spec in metadata.requires(dist) or []:
        req = Requirement(spec)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (*extras, "")):
            continue
        out.append(re.sub(r"[-_.]+", "-", req.name).lower())
    return out


@pytest.fixture(scope="module")
def core_only(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding aospec's wheel and its core dependencies only (no extra): each
    installed distribution's files linked in from this environment, so it is fast and needs
    no package index. Returns its python."""
    from importlib import metadata

    venv = tmp_path_factory.mktemp("core") / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)  # type: ignore[attr-defined]
    (site,) = (venv / "lib").glob("python*/site-packages")
    wanted, seen = _requirements("aospec"), set()
    while wanted:
        name = wanted.pop()
        if name in seen:
            continue
        seen.add(name)
        dist = metadata.distribution(name)
        root = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if not (site / top).exists() and (root / top).exists():
                (site / top).symlink_to(root / top)
        wanted.extend(_requirements(name))
    for entry in installed.iterdir():
        (site / entry.name).symlink_to(entry)
    return venv / "bin" / "python"


@pytest.mark.slow
def test_the_core_install_runs_the_bundled_sweep_and_names_the_extra_each_other_verb_needs(
    core_only: Path, tmp_path: Path
) -> None:
    def aospec(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(core_only), "-m", "aospec", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=600,
            env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
        )

    probe = subprocess.run([str(core_only), "-c", "import httpx"], capture_output=True, text=True)
    assert probe.returncode != 0, "the core-only environment has httpx: not core only"
    # the README's first command, on the core install
    done = aospec("sweep", "--bundled", "--policies", "serial,aospec", "--tpot-ms", "10", "--jobs", "1", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "results" / "summary.jsonl").is_file()
    for argv, extra in (
        (["run", "fix it", "--model", "http://127.0.0.1:9/v1"], "live"),
        (["serve-trace", "--bundled", "--tpot-ms", "10"], "live"),
        (["proxy", "--upstream", "http://127.0.0.1:9/v1"], "live"),
        (["mcp", "--stdio"], "integrations"),
    ):
        proc = aospec(*argv)
        assert proc.returncode == 2, f"aospec {argv[0]}: {proc.stderr[-2000:]}"
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, f"aospec {argv[0]}:\n{proc.stderr[-2000:]}"
        assert f"pip install 'aospec[{extra}]'" in lines[0] and f"aospec {argv[0]}" in lines[0], lines[0]
