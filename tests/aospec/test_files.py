"""New files get the mode the umask gives, also when written through mkstemp."""

from __future__ import annotations

import os

import pytest

from aospec._files import new_file_mode


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600), (0o002, 0o664)])
def test_new_file_mode_follows_the_umask(umask: int, mode: int) -> None:
    old = os.umask(umask)
    try:
        assert new_file_mode() == mode
    finally:
        os.umask(old)
