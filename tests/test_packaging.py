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
