# ruff: noqa: E402  (mini-swe-agent is imported after silencing its startup banner)
"""mini-swe-agent (2.x) on aospec: an Environment on aospec sandboxes and a co-speculating agent.

- :class:`AospecEnvironment` is a mini-swe-agent ``Environment`` whose ``execute`` runs each
  command in an aospec copy-on-write sandbox (overlay backend by default, Docker with
  ``backend: docker``) and returns the dict mini-swe-agent's ``LocalEnvironment`` returns
  (``output``, ``returncode``, ``exception_info``, and ``extra`` on a timeout), submitting
  by the same rule. Select it in mini-swe-agent's own configuration with
  ``environment_class: aospec.integrations.minisweagent.AospecEnvironment`` (mini-swe-agent's
  ``get_environment`` imports any dotted path).
- :class:`SpeculativeAgent` is mini-swe-agent's ``DefaultAgent`` whose model calls and
  command executions go through one aospec :class:`~aospec.session.Session`: the model is
  the engine's actor (:class:`ModelActor`), the environment's sandbox is the engine's
  committed sandbox. ``DefaultAgent``'s own loop, limits, templates, observation rendering,
  format-error handling and trajectory saving run unchanged; only *where* a reply and an
  output come from differs, so its messages and saved trajectory are those ``DefaultAgent``
  with the same model and environment writes.

What the engine sees. A step's action is the reply's command (``Action.bash``), or
``Action.none()`` for a reply without commands or one that raised ``FormatError``, or, for a
reply with several commands, one ``mswea_actions`` action running them in order. Its
observation is the environment's output dict, encoded without loss
(:func:`encode_outputs`): mini-swe-agent 1.7's text, as the runtime's ``mini-swe-agent`` formatter writes it (``<returncode>N</returncode>``
then ``<output>``) when the output is an ordinary one, so the observation drafters'
drafts can match it byte for byte, JSON otherwise (timeouts, several commands).
"""

from __future__ import annotations

import copy
import json
import os
import platform
import re
import subprocess
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread


def _import_quietly() -> None:
    """Import mini-swe-agent without its startup banner on stdout (which would corrupt the
    output of a program that only imports this module); a program that imported it first,
    or set ``MSWEA_SILENT_STARTUP`` itself, keeps its choice."""
    if "minisweagent" in sys.modules or "MSWEA_SILENT_STARTUP" in os.environ:
        return
    os.environ["MSWEA_SILENT_STARTUP"] = "1"
    try:
        import minisweagent  # noqa: F401
    finally:
        del os.environ["MSWEA_SILENT_STARTUP"]


_import_quietly()

from aospec.live.agent import Drafters, default_drafters, serial_config
from aospec.live.chat import ActorStats, history_digests, history_key
from minisweagent.agents.default import AgentConfig, DefaultAgent
from minisweagent.environments.local import LocalEnvironment
from minisweagent.exceptions import InterruptAgentFlow
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from aospec.engine import Engine
from aospec.errors import AospecError
from aospec.ledger import EngineStatistics
from aospec.types import Action, History
from aospec.wrappers import SandboxWrapper

__all__ = [
    "MULTI_ACTION_TOOL",
    "AospecEnvironment",
    "AospecEnvironmentConfig",
    "Decoded",
    "ModelActor",
    "SpeculativeAgent",
    "action_of",
    "decode_outputs",
    "encode_outputs",
]

#: The tool of one step whose reply holds several commands (run in order, stopping after a
#: submission, as ``DefaultAgent`` does).
MULTI_ACTION_TOOL = "mswea_actions"

_TEXT = re.compile(r"\A<returncode>(-?\d+)</returncode>\n<output>\n(.*)</output>\Z", re.DOTALL)


# -- the environment -------------------------------------------------------------------


class AospecEnvironmentConfig(BaseModel):
    """The environment's configuration (mini-swe-agent builds it from its YAML/dict config).

    ``cwd``, ``env`` and ``timeout`` mean what they mean for ``LocalEnvironment``: the
    working directory of every command (empty: the sandbox's ``workdir``, ``/``; created
    when missing), variables added to the command environment, the per-command timeout in
    seconds. ``backend`` and ``base`` choose the aospec sandbox (``runtime.SandboxConfig``),
    ``sandbox`` holds any other ``SandboxConfig`` key (``limits``, ``network``, ``binds``,
    ``state_dir``, ...).
    """

    cwd: str = ""
    env: dict[str, str] = {}
    timeout: int = 30
    backend: str = "overlay"
    base: str = "busybox"
    sandbox: dict[str, Any] = {}


def _output_of(command: str, result: Any, timeout: float) -> dict[str, Any]:
    """The ``LocalEnvironment`` output dict of a runtime ``CommandResult``."""
    # LocalEnvironment reads the pipe in text mode: universal newlines.
    out = result.output.replace("\r\n", "\n").replace("\r", "\n")
    if result.timed_out:
        exc = subprocess.TimeoutExpired(command, timeout)
        return {
            "output": out,
            "returncode": -1,
            "exception_info": f"An error occurred while executing the command: {exc}",
            "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
        }
    return {"output": out, "returncode": result.returncode, "exception_info": ""}


def _finished(output: Mapping[str, Any]) -> bool:
    """mini-swe-agent's submission rule (``LocalEnvironment._check_finished``)."""
    lines = str(output.get("output", "")).lstrip().splitlines(keepends=True)
    return bool(lines) and lines[0].strip() == "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" and output["returncode"] == 0


def encode_outputs(outputs: Sequence[Mapping[str, Any]], *, single: bool = True) -> str:
    """The observation text of a step's outputs, decodable without loss.

    One ordinary output (``exception_info`` empty, no ``extra``) is the runtime's
    mini-swe-agent text ``<returncode>N</returncode>\\n<output>\\nOUT</output>``; one other
    output is its JSON object; several (``single=False``) a JSON list; none ``""``.
    """
    if single:
        if len(outputs) != 1:
            raise AospecError(f"a single-command step has one output, got {len(outputs)}")
        o = outputs[0]
        if (
            set(o) == {"output", "returncode", "exception_info"}
            and o["exception_info"] == ""
            and type(o["returncode"]) is int
        ):
            return f"<returncode>{o['returncode']}</returncode>\n<output>\n{o['output']}</output>"
        return json.dumps(o, sort_keys=True, ensure_ascii=False)
    return json.dumps(list(outputs), sort_keys=True, ensure_ascii=False)


def decode_outputs(observation: str) -> list[dict[str, Any]]:
    """The outputs :func:`encode_outputs` encoded (``""``: none)."""
    if observation == "":
        return []
    m = _TEXT.match(observation)
    if m is not None:
        return [{"output": m.group(2), "returncode": int(m.group(1)), "exception_info": ""}]
    value = json.loads(observation)
    return value if isinstance(value, list) else [value]


def action_of(message: Mapping[str, Any]) -> Action:
    """The engine's action for a model reply: its one command, none, or all of them."""
    commands = [str(a.get("command", "")) for a in (message.get("extra") or {}).get("actions") or []]
    if not commands:
        return Action.none()
    if len(commands) == 1:
        return Action.bash(commands[0])
    return Action(MULTI_ACTION_TOOL, {"commands": commands})


class _Sandbox(SandboxWrapper):
    """The engine's view of an environment's sandbox (and, through ``fork``, of its forks):
    ``execute`` runs a step's command(s) with the environment's cwd and timeout and answers
    the encoded output dicts. A :class:`aospec.wrappers.SandboxWrapper`: the runtime
    sandbox's priority capability passes through (speculative forks run in the background)."""

    def __init__(self, inner: Any, env: AospecEnvironment) -> None:
        super().__init__(inner)
        self.env = env

    @property
    def version(self) -> str:
        return str(self.inner.version)

    async def run_one(self, command: str, cwd: str = "", timeout: float | None = None) -> dict[str, Any]:
        timeout = timeout or self.env.config.timeout
        result = await self.inner.run(command, timeout=timeout, cwd=cwd or self.env.config.cwd or None)
        return _output_of(command, result, timeout)

    async def execute(self, action: Action) -> str:
        if action.is_none:
            return ""
        if action.command is not None:
            return encode_outputs([await self.run_one(action.command)])
        if action.tool == MULTI_ACTION_TOOL:
            outputs = []
            for command in action.args["commands"]:
                outputs.append(await self.run_one(command))
                if _finished(outputs[-1]):
                    break  # DefaultAgent runs nothing after a submission
            return encode_outputs(outputs, single=False)
        raise AospecError(f"a mini-swe-agent sandbox runs bash commands, not tool {action.tool!r}")

    async def fork(self) -> _Sandbox:
        return _Sandbox(await self.inner.fork(), self.env)


def _close(portal_cm: Any, sandbox_cm: Any) -> None:
    try:
        sandbox_cm.__exit__(None, None, None)
    finally:
        portal_cm.__exit__(None, None, None)


class AospecEnvironment:
    """A mini-swe-agent Environment running every command in an aospec sandbox.

    The sandbox opens with the environment (its event loop runs in a thread of its own)
    and closes with :meth:`close` (or ``with``; at the latest when the environment is
    garbage collected or the interpreter exits). Differences from ``LocalEnvironment``:
    commands run isolated in the sandbox, not on the host (so the environment is the
    sandbox's ``PATH``, ``HOME=/root``, ``PYTHONDONTWRITEBYTECODE=1`` and ``env``, not the
    host's ``os.environ``, and ``get_template_vars`` holds that environment, not the
    host's); the default working directory is the sandbox's ``/``, not the host process's;
    a runtime failure (the sandbox itself failing) raises instead of becoming an output.
    """

    def __init__(self, *, config_class: type = AospecEnvironmentConfig, **kwargs: Any) -> None:
        self.config = config_class(**kwargs)
        from aospec.runtime import SandboxConfig, open_sandbox

        fields = {"backend": self.config.backend, "base": self.config.base, "timeout_s": self.config.timeout}
        fields.update(self.config.sandbox)
        if self.config.env:
            fields["env"] = {**dict(fields.get("env") or {}), **self.config.env}
        self.sandbox_config = SandboxConfig.from_mapping(fields)
        portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = portal_cm.__enter__()
        try:
            sandbox_cm = self.portal.wrap_async_context_manager(open_sandbox(self.sandbox_config))
            root = sandbox_cm.__enter__()
        except BaseException:
            portal_cm.__exit__(None, None, None)
            raise
        self.sandbox = _Sandbox(root, self)
        self._finalizer = weakref.finalize(self, _close, portal_cm, sandbox_cm)
        if self.config.cwd:
            try:
                self.portal.call(self._make_cwd)
            except BaseException:
                self.close()
                raise

    async def _make_cwd(self) -> None:
        import shlex

        # a one-off setup step: a generous timeout, since a loaded host can be slow to start one
        timeout = max(self.config.timeout, 300)
        result = await self.sandbox.inner.run(f"mkdir -p -- {shlex.quote(self.config.cwd)}", cwd="/", timeout=timeout)
        if result.returncode != 0:
            why = f"timed out after {timeout} s" if result.timed_out else f"exit status {result.returncode}"
            raise AospecError(
                f"cannot create the working directory {self.config.cwd!r} ({why}): {result.output.strip()}"
            )

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` in the sandbox; ``LocalEnvironment``'s output dict."""
        command = action.get("command", "")
        output = self.portal.call(self.sandbox.run_one, command, cwd, timeout)
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict) -> None:
        """Raises ``Submitted`` when the output submits (``LocalEnvironment``'s rule)."""
        LocalEnvironment._check_finished(self, output)  # type: ignore[arg-type]

    def command_env(self) -> dict[str, str]:
        """The environment every command gets."""
        from aospec.runtime.isolation import DEFAULT_PATH

        return {"PATH": DEFAULT_PATH, "HOME": "/root", **self.sandbox_config.env}

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), self.command_env(), kwargs)

    def serialize(self) -> dict:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                }
            }
        }

    @property
    def version(self) -> str:
        """The sandbox's content version (equal for equal filesystem states)."""
        return self.sandbox.version

    def read_file(self, path: str) -> bytes:
        """A file's content inside the sandbox."""
        return bytes(self.portal.call(self.sandbox.inner.read_file, path))

    def close(self) -> None:
        """Close the sandbox (idempotent)."""
        self._finalizer()

    def __enter__(self) -> AospecEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the model as the engine's actor ---------------------------------------------------


@dataclass(frozen=True)
class Decoded:
    """One finished model call: the reply message, or the exception ``query`` raised
    (a ``FormatError`` carries its messages), with the engine's action and, for
    mini-swe-agent's scripted test models, the model's ``current_index`` after the call."""

    action: Action
    message: dict[str, Any] | None = None
    error: Exception | None = None
    index_after: int | None = None


def _scripted_start(outputs: Sequence[Any], step: int) -> int:
    """Where a scripted test model's answer to the ``step``-th query starts: its outputs
    are consumed one per query, plus the ``/sleep`` and ``/warning`` outputs it skips."""
    real = [
        i
        for i, o in enumerate(outputs)
        if not any(
            str(a.get("command", "")).startswith(("/sleep ", "/warning"))
            for a in ((o.get("extra") or {}).get("actions") or [])
        )
    ]
    return 0 if step == 0 else (real[step - 1] + 1 if step - 1 < len(real) else len(outputs))


class ModelActor:
    """A mini-swe-agent ``Model`` as an aospec actor: ``decode(history)`` calls
    ``model.query`` (in a worker thread) with the messages ``DefaultAgent`` would have
    built for that history, and memoises the reply per history (the first to finish is
    kept), so a history's reply is unique within a run.

    Messages: the harness registers the exact messages of each verified history
    (:meth:`set_messages`); a provisional history extends one with the memoised replies and
    observations rendered by the model's own ``format_observation_messages`` with the
    agent's template variables. mini-swe-agent's scripted test models
    (``DeterministicModel`` and its tool-call variants, which answer by call count) are
    queried on a copy positioned at the history's step, so they answer as a function of
    the history, as a deterministic model does.
    """

    def __init__(
        self, model: Any, template_vars: Callable[..., dict[str, Any]] | None = None, *, calls_before: int = 0
    ) -> None:
        self.model = model
        self.template_vars = template_vars or (lambda **kw: dict(kw))
        self.calls_before = calls_before  # the agent's n_calls when the run began (it is never reset)
        # a scripted model continues where an earlier run of the same model left it
        self.offset = model.current_index + 1 if self.scripted else 0
        self.memo: dict[str, Decoded] = {}
        self.known: dict[str, list[dict[str, Any]]] = {}
        self.stats = ActorStats()

    @property
    def scripted(self) -> bool:
        return isinstance(getattr(self.model, "current_index", None), int) and isinstance(
            getattr(getattr(self.model, "config", None), "outputs", None), list
        )

    def set_messages(self, history: History, messages: Sequence[dict[str, Any]]) -> None:
        """The exact messages of a verified history."""
        self.known[history_key(history)] = list(messages)

    def reply_for(self, history: History) -> Decoded | None:
        return self.memo.get(history_key(history))

    def messages_for(self, history: History) -> list[dict[str, Any]]:
        """The messages ``DefaultAgent`` sends for ``history``."""
        digests = list(history_digests(history))
        start = next((j for j in range(len(digests) - 1, -1, -1) if digests[j] in self.known), None)
        if start is None:
            raise AospecError("no verified prefix of this history is known: call set_messages first")
        messages = list(self.known[digests[start]])
        for k in range(start, len(history.turns)):
            decoded = self.memo.get(digests[k])
            if decoded is None:
                raise AospecError(f"the reply of turn {k} is unknown")
            if decoded.error is not None:
                messages.extend(getattr(decoded.error, "messages", ()))
                continue
            assert decoded.message is not None
            messages.append(decoded.message)
            outputs = decode_outputs(history.turns[k].observation)
            if outputs:
                tv = self.template_vars(n_model_calls=self.calls_before + k + 1)
                messages.extend(self.model.format_observation_messages(decoded.message, outputs, tv))
        return messages

    def _query(self, messages: list[dict[str, Any]], step: int) -> Decoded:
        model = self.model
        if self.scripted:
            model = copy.copy(self.model)
            model.current_index = self.offset + _scripted_start(model.config.outputs[self.offset :], step) - 1
        index = lambda: model.current_index if self.scripted else None  # noqa: E731
        try:
            message = model.query(messages)
        except Exception as exc:  # kept: the harness raises it when this history is verified
            return Decoded(Action.none(), error=exc, index_after=index())
        return Decoded(action_of(message), message=message, index_after=index())

    async def decode(self, history: History) -> Action:
        key = history_key(history)
        known = self.memo.get(key)
        if known is not None:
            self.stats.memo_hits += 1
            return known.action
        if history.turns and any(_finished(o) for o in _safe_outputs(history.turns[-1].observation)):
            return Action.none()  # the run has ended here: the harness never asks
        try:
            messages = self.messages_for(history)
        except ValueError:
            # a drafted observation no step can produce (not an encoding of output dicts):
            # this history never happens, so the model is not asked
            return Action.none()
        self.stats.requests += 1
        decoded = await anyio.to_thread.run_sync(self._query, messages, len(history.turns), abandon_on_cancel=True)
        kept = self.memo.setdefault(key, decoded)
        if kept is not decoded:
            self.stats.duplicate_replies += 1
        else:
            self.stats.replies += 1
        return kept.action


def _safe_outputs(observation: str) -> list[dict[str, Any]]:
    try:
        return decode_outputs(observation)
    except ValueError:
        return []


# -- the agent ---------------------------------------------------------------------------


class _SessionModel:
    """The model as ``DefaultAgent.query`` sees it inside a speculative run: ``query``
    answers from the session; everything else is the real model's."""

    def __init__(self, agent: SpeculativeAgent, model: Any) -> None:
        self._agent = agent
        self._model = model

    def query(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        return self._agent._decode_verified(messages)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _load_train(paths: list[str]) -> list[Any]:
    """The training traces under ``paths`` (``bundled``: the traces shipped with aospec)."""
    if not paths:
        return []
    from aospec.replay import bundled_traces_path, load_traces

    return load_traces([bundled_traces_path() if p == "bundled" else p for p in paths])


class SpeculativeAgent(DefaultAgent):
    """``DefaultAgent`` co-speculating through one aospec session.

    ``env`` must be an :class:`AospecEnvironment` (its sandbox is the committed sandbox).
    The drafters are ``drafters`` when given (:class:`aospec.live.agent.Drafters`), else those of
    the replay policy ``policy`` (default ``aospec``) fitted on the traces under ``train``
    (paths; ``bundled`` names the traces shipped with aospec; none: unfitted), built by
    :func:`aospec.live.agent.default_drafters`. ``policy`` and ``train`` can come from
    mini-swe-agent's YAML (``agent: {agent_class: aospec.integrations.minisweagent.SpeculativeAgent,
    train: [bundled]}``). ``speculate=False`` runs the same session serially. Everything
    else is ``DefaultAgent``'s keyword configuration. After a run, ``statistics`` holds the
    engine's figures; the trajectory holds none of them, so it stays what ``DefaultAgent``
    writes (``info.config.agent_type`` names this class).

    Lossless when the model answers as a function of its messages (greedy or seeded, or
    mini-swe-agent's scripted test models), commands as a function of the filesystem, and
    the observation template does not use time-varying variables (``elapsed_seconds``).
    """

    def __init__(
        self,
        model: Any,
        env: Any,
        *,
        drafters: Drafters | None = None,
        speculate: bool = True,
        policy: str = "aospec",
        train: Sequence[str] | str = (),
        config_class: type = AgentConfig,
        **kwargs: Any,
    ) -> None:
        if not isinstance(env, AospecEnvironment):
            raise AospecError(
                f"SpeculativeAgent needs an aospec.integrations.minisweagent.AospecEnvironment, got {type(env).__name__}"
            )
        super().__init__(model, env, config_class=config_class, **kwargs)
        if drafters is None and speculate:
            drafters = default_drafters(_load_train([train] if isinstance(train, str) else list(train)), policy)
        self.drafters = drafters
        self.speculate = speculate
        self.actor: ModelActor | None = None
        self.engine: Engine | None = None
        self.statistics: EngineStatistics | None = None
        self._session: Any = None
        self._pending: tuple[dict[str, Any], Action] | None = None
        self._last: Decoded | None = None

    def _engine(self, actor: ModelActor) -> Engine:
        sandbox = self.env.sandbox
        if not self.speculate:
            return Engine(actor, sandbox, config=serial_config())
        d = self.drafters if self.drafters is not None else default_drafters(())
        return Engine(  # a fresh engine per run: its statistics are that run's
            actor, sandbox, observation_drafters=d.observation, action_drafters=d.action, evd=d.evd, config=d.config
        )

    def run(self, task: str = "", **kwargs: Any) -> dict:
        self.actor = ModelActor(self.model, template_vars=self.get_template_vars, calls_before=self.n_calls)
        self.engine = self._engine(self.actor)
        portal = self.env.portal
        self._last = None
        try:
            with portal.wrap_async_context_manager(self.engine.session(History(task))) as session:
                self._session = session
                try:
                    return super().run(task, **kwargs)
                finally:
                    self._session = None
        finally:
            self.statistics = self.engine.statistics()
            last = self._last
            if self.actor.scripted and last is not None and last.index_after is not None:
                self.model.current_index = last.index_after  # where DefaultAgent leaves it

    def query(self) -> dict:
        if self._session is None:
            raise AospecError("SpeculativeAgent.query runs inside run()")
        real = self.model
        self.model = _SessionModel(self, real)
        try:
            return super().query()
        finally:
            self.model = real

    def _decode_verified(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.actor is not None
        session, portal = self._session, self.env.portal
        history = session.history
        self.actor.set_messages(history, messages)
        action = portal.call(session.decode)
        decoded = self.actor.reply_for(history)
        assert decoded is not None and decoded.action == action
        self._last = decoded
        if decoded.error is not None:
            if isinstance(decoded.error, InterruptAgentFlow):
                portal.call(session.execute, Action.none())  # the step is committed; the run goes on
            raise decoded.error
        assert decoded.message is not None
        self._pending = (decoded.message, action)
        return decoded.message

    def execute_actions(self, message: dict) -> list[dict]:
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not message:
            return super().execute_actions(message)
        observation = self.env.portal.call(self._session.execute, pending[1])
        outputs = decode_outputs(observation)
        for output in outputs:
            self.env._check_finished(output)
        return self.add_messages(*self.model.format_observation_messages(message, outputs, self.get_template_vars()))
