"""Every fenced code block in README.md and docs/*.md runs as written.

``python`` blocks run in a fresh interpreter, ``bash`` blocks with ``bash -e``. The blocks
of one markdown file run in order in one scratch copy of the repository (a block may use
what an earlier block of the same file wrote, e.g. ``out/train``; the repository itself is
never written), with this environment's ``aospec`` and ``python`` first on ``PATH``.
``json`` blocks must parse (one JSON value, or one per line); blocks without a language
(directory trees, layouts) are text.

An HTML comment on the line right before a fence qualifies the block:

- ``<!-- not run: REASON -->``: the block needs what no test machine has (real model
  weights, a server left running, the package index). The reason is required, is shown as
  the skip reason, and such blocks are kept few (``MAX_NOT_RUN``).
- ``<!-- needs: root, docker, gpu -->``: the block runs where those are available (root
  with overlayfs for sandboxes, a reachable Docker daemon, a CUDA device) and is skipped,
  naming what is missing, elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
DATA = {"json", "text", ""}
NEEDS = {"root", "docker", "gpu"}
MAX_NOT_RUN = 8
BLOCK_TIMEOUT_S = 600  # a hang guard per block, not a performance assertion
#: Pages whose every block needs something, marked or not (sandboxes need root).
PAGE_NEEDS = {"docs/runtime.md": ("root",)}
#: Pages whose blocks run in seconds: the fast tier (``scripts/test.sh --fast``, ``-m "not
#: slow"``) runs their blocks; every other page's runnable blocks are marked ``slow`` (a
#: page's blocks run in order, each after the earlier ones, so a page is fast or slow whole).
FAST_PAGES = frozenset({"docs/cli.md", "docs/trace-format.md", "docs/architecture.md"})
#: Blocks (page, first line) that do not run as written yet, with why; a listed block
#: that is gone or marked fails test_pending_blocks_still_exist_unmarked.
PENDING: dict[tuple[str, str], str] = {}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<lang>[^`\s]*)[^`]*$")
_MARK = re.compile(r"^\s*<!--\s*(?P<kind>not run|needs)\s*:\s*(?P<text>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    index: int
    line: int
    lang: str
    code: str
    not_run: str | None = None
    needs: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{_name(self.page)}:{self.line}"


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def parse_blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` with their markers (a fence's indentation is removed
    from its lines, so blocks inside list items run too)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m["indent"], m["fence"], m["lang"].lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""):
            text = lines[i]
            body.append(text[len(indent):] if text.startswith(indent) else text.lstrip())
            i += 1
        if i == len(lines):
            raise AssertionError(f"{_name(page)}:{start + 1}: code fence never closed")
        i += 1
        not_run, needs = None, PAGE_NEEDS.get(_name(page), ())
        mark = _MARK.match(lines[start - 1]) if start else None
        if mark and mark["kind"] == "not run":
            not_run = mark["text"]
        elif mark:
            needs = tuple(dict.fromkeys([*needs, *(x.strip() for x in mark["text"].split(","))]))
        blocks.append(Block(page, len(blocks), start + 1, lang, "\n".join(body) + "\n", not_run, needs))
    return blocks


BLOCKS = [b for page in PAGES for b in parse_blocks(page)]


def _missing(needs: tuple[str, ...]) -> list[str]:
    missing = []
    if "root" in needs and (os.geteuid() != 0 or "overlay" not in Path("/proc/filesystems").read_text()):
        missing.append("root with overlayfs (sandboxes)")
    if "docker" in needs and (
        shutil.which("docker") is None
        or subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0
    ):
        missing.append("a running Docker daemon")
    if "gpu" in needs:
        probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
        if subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120).returncode != 0:
            missing.append("a CUDA device")
    return missing


def _copy_repo(dest: Path) -> Path:
    """A scratch copy of the repository (sources, docs, scripts, bundled data), with the
    environment's ``.venv`` linked in so that ``.venv/bin/...`` commands work as written."""
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", "results", "out"
    )
    work = dest / ROOT.name
    shutil.copytree(ROOT, work, ignore=ignore, symlinks=True)
    (work / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return work


@dataclass
class _Page:
    work: Path
    outcomes: dict[int, subprocess.CompletedProcess[str] | None] = field(default_factory=dict)


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    env["MPLBACKEND"] = "Agg"
    return env


def _pending(block: Block) -> str | None:
    return PENDING.get((_name(block.page), block.code.splitlines()[0] if block.code.strip() else ""))


def _execute(block: Block, work: Path) -> subprocess.CompletedProcess[str] | None:
    if block.not_run is not None or _pending(block) is not None or _missing(block.needs):
        return None
    command = [sys.executable, "-"] if RUN[block.lang] == "python" else ["bash", "-e", "-o", "pipefail", "-s"]
    return subprocess.run(
        command, input=block.code, cwd=work, env=_environment(), capture_output=True, text=True,
        timeout=BLOCK_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def pages() -> dict[Path, _Page]:
    """The scratch copy of each page's blocks, made when its first block runs."""
    return {}


def _page(pages: dict[Path, _Page], page: Path, tmp_path_factory: pytest.TempPathFactory) -> _Page:
    if page not in pages:
        pages[page] = _Page(_copy_repo(tmp_path_factory.mktemp(page.stem)))
    return pages[page]


@pytest.mark.timeout(3 * BLOCK_TIMEOUT_S)  # run alone, a block first runs its page's earlier blocks
def _param(block: Block) -> object:
    slow = _name(block.page) not in FAST_PAGES or block.needs
    return pytest.param(block, marks=pytest.mark.slow if slow else (), id=block.id)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if b.lang in RUN])
def test_code_block_runs_as_written(block: Block, pages: dict[Path, _Page],
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    if block.not_run is not None:
        pytest.skip(f"not run: {block.not_run}")
    if _pending(block) is not None:
        pytest.skip(f"pending (temporary allowance in tests/test_docs.py): {_pending(block)}")
    missing = _missing(block.needs)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    page = _page(pages, block.page, tmp_path_factory)
    for earlier in BLOCKS:
        # Run alone (-k), a block still finds what the earlier blocks of its page made.
        earlier_here = earlier.page == block.page and earlier.index < block.index
        if earlier_here and earlier.lang in RUN and earlier.index not in page.outcomes:
            page.outcomes[earlier.index] = _execute(earlier, page.work)
    result = _execute(block, page.work)
    page.outcomes[block.index] = result
    assert result is not None
    assert result.returncode == 0, (
        f"{block.id} ({block.lang}) exited {result.returncode}\n--- block ---\n{block.code}"
        f"--- stdout (tail) ---\n{result.stdout[-3000:]}\n--- stderr (tail) ---\n{result.stderr[-3000:]}"
    )


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "json"], ids=lambda b: b.id)
def test_json_block_parses(block: Block) -> None:
    try:
        json.loads(block.code)
    except json.JSONDecodeError:
        for n, line in enumerate(block.code.splitlines(), block.line + 1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as exc:
                    pytest.fail(f"{_name(block.page)}:{n}: not JSON: {exc}")


def test_every_block_has_a_known_language_and_valid_markers() -> None:
    for b in BLOCKS:
        assert b.lang in RUN or b.lang in DATA, f"{b.id}: unknown code block language {b.lang!r}"
        if b.not_run is not None:
            assert len(b.not_run) >= 10, f"{b.id}: `not run` needs a reason saying what the block needs"
            assert b.lang in RUN, f"{b.id}: only runnable blocks take `not run`"
        unknown = set(b.needs) - NEEDS
        assert not unknown, f"{b.id}: unknown `needs` {sorted(unknown)} (known: {sorted(NEEDS)})"


def test_pending_blocks_still_exist_unmarked() -> None:
    unmarked = {(_name(b.page), b.code.splitlines()[0]) for b in BLOCKS if b.not_run is None and b.code.strip()}
    stale = sorted(set(PENDING) - unmarked)
    assert not stale, f"remove these from PENDING (fixed, marked or gone): {stale}"


def test_blocks_not_run_are_few() -> None:
    not_run = [f"{b.id}: {b.not_run}" for b in BLOCKS if b.not_run is not None]
    assert len(not_run) <= MAX_NOT_RUN, "too many blocks marked `not run`:\n" + "\n".join(not_run)


def test_parser_reads_markers_and_indented_fences(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "text\n<!-- not run: needs a GPU and real weights -->\n```bash\nexit 1\n```\n"
        "- item\n\n  <!-- needs: root, docker -->\n  ```python\n  print(1)\n\n  ```\n"
        "```\nlayout\n```\n",
        encoding="utf-8",
    )
    a, b, c = parse_blocks(page)
    assert (a.lang, a.not_run, a.code) == ("bash", "needs a GPU and real weights", "exit 1\n")
    assert (b.lang, b.needs, b.code, b.line) == ("python", ("root", "docker"), "print(1)\n\n", 9)
    assert (c.lang, c.not_run, c.needs) == ("", None, ())

