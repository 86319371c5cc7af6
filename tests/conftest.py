"""Settings every test process (and every aospec process a test starts) shares."""

from __future__ import annotations

import os

# Why: aospec run and aospec mcp share one host budget by default (one speculative fork per
# two cores, over every aospec process of the host), so tests that speculate several calls
# at once, or run beside another aospec process, would see each other's slots. The tests of
# that default unset this (tests/aospec/test_host.py, tests/integrations/test_mcp_server.py).
os.environ.setdefault("AOSPEC_SPECULATION_BUDGET", "none")
