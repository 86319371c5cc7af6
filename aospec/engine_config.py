"""Configuration of the speculation engine (Algorithm 1).

Build one from a mapping with :func:`engine_config` (unknown keys raise ConfigError), or
directly. Every baseline of the replay benchmark is an ``EngineConfig`` plus a choice of
drafters (see replay/policies.py and docs/engine.md). Objects (drafters, the canonicaliser
of ``accept="canonical"``) are passed to :class:`aospec.engine.Engine`, never named here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from aospec.config import from_mapping
from aospec.errors import ConfigError

__all__ = ["ACCEPTANCE", "ADMISSION", "RANKINGS", "EngineConfig", "engine_config"]

#: How observation drafts are ranked before the branch budget is applied.
RANKINGS = ("evd", "likelihood", "tooltime")

#: When a drafted observation is accepted for the real one.
ACCEPTANCE = ("exact", "canonical")

#: Whether the speculation controller prices guesses (``on``) or every guess is launched as
#: drafted (``off``).
ADMISSION = ("on", "off")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Knobs of Algorithm 1.

    - ``branch_budget``: provisional actor continuations started per action in flight
      (observation speculation); 0 disables observation speculation.
    - ``draft_candidates``: candidates requested from the observation drafters before
      ranking (at least ``branch_budget``).
    - ``obs_depth``: how many drafted observations deep a provisional branch may run ahead
      of the verified history (1 = the next observation only).
    - ``rank``: ``evd`` ranks drafts by ``p(c) * T(c)`` (expected tool time hidden),
      ``likelihood`` by ``p(c)``, ``tooltime`` by ``T(c)``.
    - ``fork_width``: speculative target actions launched into sandbox forks per verified
      boundary; 0 disables action speculation from the action drafters.
    - ``depth``: lookahead; targets with step offset ``< depth`` are launched (1 = the next
      action only).
    - ``provisional_targets``: launch the action a provisional continuation decodes into a
      fork of the committed sandbox at once (valid if the step in flight leaves the
      filesystem unchanged, checked by JASV).
    - ``max_live_forks``: forks kept at once (oldest are discarded first).
    - ``routed_width``: with a stream router given to the Engine (and a streaming actor),
      target actions launched per router event from the action drafters that have
      ``propose_routed`` (offset 0: the action being decoded); 0 disables routed drafting
      (router events are still recorded and passed to the route listeners). Needs action
      speculation on (``fork_width > 0``).
    - ``min_draft_probability``: drafts less likely than this are never continued.
    - ``accept``: ``exact`` (default) keeps a continuation only if its draft is
      byte-identical to the real observation; ``canonical`` also keeps one whose draft
      equals it after canonicalisation by the ``canonicalizer`` object given to the
      Engine (e.g. ``aospec.drafters.canonicalize.Canonicalizer()``: process ids, temp names,
      times). The committed history always holds the real observation; ``canonical`` is
      lossless only if the actor's next action does not depend on the canonicalised
      fields (docs/engine.md).
    - ``admission``: ``on`` (default) prices every guess before launching it and launches it
      only when its expected benefit exceeds its expected cost (``aospec.admission``,
      docs/engine.md "The speculation controller"); ``off`` launches every guess the knobs
      above allow, as before the controller existed.
    - ``cpu_price``: seconds of latency one CPU-second of a guess is worth on a quiet host
      (the host's load adds to it).
    - ``decode_price``: seconds of latency one second of a wasted provisional decode costs
      (the model endpoint's time; raise it for a model on this host).
    - ``stream_cores``: cores of this host one decode stream takes, an observation branch's
      local price (its wasted decode seconds times this, at the host's price of a
      CPU-second). None (default): measured live from this process's CPU beside its open
      streams (``aospec.host.DecodeMeter``), 0 before the first measurement and in replay;
      a number fixes it (0: streams cost this host nothing; about the cores it decodes on
      for a model served on this host).
    - ``drafting_cpu_s``: CPU-seconds of this process one drafting round takes (a boundary's
      targets, a branch's observations, a routed tool's targets; drafting is priced like a
      guess: a round is skipped while the last ones, priced at the host's price now, would
      not have paid for it). None (default): measured live per kind of round, 0 before the
      first measurement and in replay (drafting is then never skipped); a number fixes it
      (0: drafting is free, never skipped).
    - ``guard_window``: steps over which the no-regret guard compares the realised benefit
      of speculation with its cost (0: no guard).
    - ``read_sets``: read-set validation (docs/engine.md, "Read sets"): where the sandbox
      records what speculative commands read (:class:`aospec.protocols.ReadSetSandbox`), a
      fork from an older origin is reused when nothing committed since touched what it read
      or wrote, and rebased onto the committed state. Without the capability it does nothing.
    - ``steps_in_place``: with speculation on, run each committed step directly on the
      committed sandbox, as serial execution does, where the sandbox keeps forking guesses
      at the state before a running command (``forks_during_execute``: the overlay backend);
      no fork and no commit on the critical path. False (or a sandbox without it): each
      step runs in a fresh fork that is then committed.
    """

    branch_budget: int = 5
    draft_candidates: int = 8
    obs_depth: int = 1
    rank: Literal["evd", "likelihood", "tooltime"] = "evd"
    fork_width: int = 8
    depth: int = 2
    provisional_targets: bool = True
    max_live_forks: int = 32
    min_draft_probability: float = 0.0
    accept: Literal["exact", "canonical"] = "exact"
    routed_width: int = 2
    admission: Literal["on", "off"] = "on"
    cpu_price: float = 0.2
    decode_price: float = 0.0
    stream_cores: float | None = None
    drafting_cpu_s: float | None = None
    guard_window: int = 16
    read_sets: bool = True
    steps_in_place: bool = True

    def __post_init__(self) -> None:
        for name in (
            "branch_budget",
            "draft_candidates",
            "fork_width",
            "max_live_forks",
            "routed_width",
            "guard_window",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"engine: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("obs_depth", "depth"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine: {name} must be >= 1, got {getattr(self, name)}")
        if self.rank not in RANKINGS:
            raise ConfigError(f"engine: rank must be one of {', '.join(RANKINGS)}, got {self.rank!r}")
        if not 0.0 <= self.min_draft_probability <= 1.0:
            raise ConfigError(f"engine: min_draft_probability must be in [0, 1], got {self.min_draft_probability}")
        if self.admission not in ADMISSION:
            raise ConfigError(f"engine: admission must be one of {', '.join(ADMISSION)}, got {self.admission!r}")
        for name in ("cpu_price", "decode_price"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"engine: {name} must be a finite number >= 0, got {value!r}")
        for name in ("stream_cores", "drafting_cpu_s"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
            ):
                raise ConfigError(f"engine: {name} must be a finite number >= 0 or None (measured), got {value!r}")
        if self.accept not in ACCEPTANCE:
            raise ConfigError(f"engine: accept must be one of {', '.join(ACCEPTANCE)}, got {self.accept!r}")


def engine_config(mapping: Mapping[str, Any], *, where: str = "engine") -> EngineConfig:
    """An EngineConfig from a mapping; unknown keys and bad values raise ConfigError."""
    return from_mapping(EngineConfig, mapping, where=where)
