"""``aospec run``: a live bash agent on the engine, with a progress line, a summary and an
optional recording of its trace (docs/live.md).

Exit status: 0 when the run ended (submitted or at the step limit), 1 when it failed (the
model endpoint, the sandbox, a step), 2 for usage errors (bad options, missing files),
130 on Ctrl-C. Errors are one line on stderr; whatever was committed is in the recording.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aospec._http import port_number
from aospec.cli._common import add_alias, add_format_option, print_json, print_table
from aospec.errors import AospecError, ConfigError

__all__ = ["register"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a live bash agent on a task, speculating (or serially), optionally recording its trace",
        description="Run a mini-swe-agent-style bash agent on TASK: the model at --model decides, a copy-on-write "
        "sandbox executes one command per step, and the engine co-speculates observations and actions (lossless: "
        "the committed trajectory is the serial run's). Ends when a command's output starts with "
        "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT, or at the step limit. "
        'Example: aospec run "write hello.py and run it" --model http://127.0.0.1:8000/v1 --record run.jsonl',
    )
    p.add_argument("task", help="the task text")
    p.add_argument(
        "--model",
        required=True,
        help="an OpenAI-compatible API root (http(s)://...), a model name (smollm2: run in this process) or a "
        "local model path (a Hugging Face directory, a .gguf file, an aospec train output)",
    )
    p.add_argument("--model-name", default=None, help="the model name sent to the endpoint (default: 'default')")
    p.add_argument(
        "--api-key-env", default=None, metavar="VAR", help="environment variable holding the API key (default OPENAI_API_KEY)"
    )
    p.add_argument(
        "--backend", dest="sandbox", default="overlay", choices=("overlay", "docker"), help="sandbox backend (default overlay)"
    )
    add_alias(p, "--sandbox", "--backend")
    p.add_argument("--base", default="busybox", help="base filesystem: busybox (default), debootstrap[:SUITE], image:NAME, a directory")
    p.add_argument(
        "--speculate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="co-speculate observations and actions (default); --no-speculate runs serially",
    )
    p.add_argument("--record", default=None, metavar="FILE", help="record the run as a canonical trace (JSONL)")
    p.add_argument(
        "--record-read-sets",
        action="store_true",
        help="with --record: trace every command's reads (strace; slows the committed steps) and record each step's "
        "read and write sets, for replay --state-model readsets (overlay sandbox)",
    )
    p.add_argument(
        "--train-traces",
        action="append",
        default=[],
        metavar="DIR",
        help="traces to fit the drafters on (repeatable; files or directories)",
    )
    p.add_argument(
        "--policy",
        default="aospec",
        help="the drafters of a speculative run, as a replay policy (default aospec: patterns+cache observations, "
        "history actions), e.g. aospec:obs_drafter=lm+patterns+cache with --drafter-options",
    )
    p.add_argument(
        "--drafter-options",
        default=None,
        metavar="JSON",
        help='options per drafter name, as aospec sweep takes them, e.g. \'{"lm": {"model": "out/smollm2-obs"}}\'',
    )
    p.add_argument("--step-limit", type=int, default=50, help="most steps (default 50; 0: no limit)")
    p.add_argument("--system-template", default=None, metavar="FILE", help="system message template")
    p.add_argument("--instance-template", default=None, metavar="FILE", help="first user message template ({task})")
    p.add_argument("--action-format", default="bash", choices=("bash", "tools"), help="bash blocks (default) or tool calls")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed sent to the endpoint")
    p.add_argument("--max-tokens", type=int, default=None, help="most output tokens per reply")
    p.add_argument("--device", default="cpu", help="device of a local model (cpu, cuda, cuda:1; default cpu)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per model request (default 600)")
    p.add_argument("--retries", type=int, default=2, help="retries of a failed model request (default 2)")
    p.add_argument("--command-timeout", type=float, default=30.0, help="seconds per command in the sandbox (default 30)")
    p.add_argument(
        "--check-determinism",
        action="store_true",
        help="send the first request twice and warn when the replies differ (speculation is lossless only then)",
    )
    p.add_argument("--progress", action="store_true", help="show the progress line even when stderr is not a terminal")
    p.add_argument(
        "--speculation-budget",
        default=None,
        metavar="CORES[,MEMORY]",
        help="the most speculative forks running at once on this host, in cores (and memory: 4G), shared by "
        "every aospec session of the host; auto (the default, or $AOSPEC_SPECULATION_BUDGET): one per two cores; "
        "none: no host budget; 0: no speculative forks",
    )
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="the speculation controller's model (JSON): loaded when the file exists, else fitted on "
        "--train-traces; saved after the run with what it learned",
    )
    p.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics while the run lasts (loopback only; 0: any "
        "free port; $AOSPEC_TOKEN, when set, is required as a bearer token). Needs prometheus_client "
        "(pip install 'aospec[metrics]')",
    )
    box = p.add_argument_group(
        "SpecBox layer (docs/live.md, 'SpecBox under a live run'; defaults apply when speculating, a serial run "
        "uses none of it unless asked)"
    )
    box.add_argument(
        "--cache",
        default=None,
        choices=("off", "reads"),
        help="reads: serve repeated read-only commands whose output depends only on the filesystem version (cat, "
        "head, grep, wc, ls without -l, ...) from a result cache keyed by that version (default reads when "
        "speculating, off serially)",
    )
    box.add_argument(
        "--pool-depth",
        type=int,
        default=None,
        metavar="N",
        help="forks of the committed sandbox made ahead of time, so a speculative fork is a queue pop (default 0: "
        "off; docs/live-benchmark.md has why)",
    )
    box.add_argument(
        "--router",
        default=None,
        choices=("off", "parse", "trained"),
        help="read the model's stream and name the command's program before the reply ends, to fork its likely "
        "commands early: parse (exact), trained (keyword + TF-IDF + parse fitted on --train-traces; needs "
        "scikit-learn), off (default; docs/live-benchmark.md has why)",
    )
    box.add_argument(
        "--markov",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add a Markov tool-transition drafter (fitted on --train-traces, updated after every step) to the "
        "action drafters (default off)",
    )
    add_format_option(p)
    p.set_defaults(func=_run)


# -- the handler ------------------------------------------------------------------------------


def _err(message: str) -> None:
    print(f"aospec: error: {message}", file=sys.stderr)


def _warn(message: str) -> None:
    print(f"aospec: warning: {message}", file=sys.stderr)


def _check_args(args: argparse.Namespace) -> None:
    """Usage errors, before anything starts."""
    if not args.task.strip():
        raise ConfigError("the task is empty")
    if args.step_limit < 0:
        raise ConfigError(f"--step-limit must be >= 0 (0: no limit), got {args.step_limit}")
    for flag, value in (("--request-timeout", args.request_timeout), ("--command-timeout", args.command_timeout)):
        if not value > 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")
    if args.retries < 0:
        raise ConfigError(f"--retries must be >= 0, got {args.retries}")
    if args.max_tokens is not None and args.max_tokens <= 0:
        raise ConfigError(f"--max-tokens must be > 0, got {args.max_tokens}")
    if not 0.0 <= args.temperature <= 2.0:
        raise ConfigError(f"--temperature must be within 0..2, got {args.temperature}")
    for flag, path in (("--system-template", args.system_template), ("--instance-template", args.instance_template)):
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    if args.record_read_sets and (args.record is None or args.sandbox != "overlay"):
        raise ConfigError("--record-read-sets needs --record FILE and the overlay sandbox")
    if args.record_read_sets:
        from aospec.runtime.readsets import tracer_support

        if not tracer_support().ok:
            raise ConfigError(f"--record-read-sets: read sets are {tracer_support().detail}")
    if args.record is not None and Path(args.record).is_dir():
        raise ConfigError(f"--record {args.record} is a directory; give a file name")
    is_url = args.model.startswith(("http://", "https://"))
    if not is_url:
        from aospec.drafters.model import NAMED_MODELS, check_model_spec

        if args.model not in NAMED_MODELS and not Path(args.model).exists():
            raise ConfigError(
                f"--model {args.model}: neither an http(s) URL, a model name ({', '.join(NAMED_MODELS)}) "
                "nor an existing local model path"
            )
        check_model_spec(args.model)  # a named model's missing package: the commands that install it
    if args.api_key_env is not None and not os.environ.get(args.api_key_env):
        raise ConfigError(f"--api-key-env {args.api_key_env}: the variable is not set")
    if args.pool_depth is not None and args.pool_depth < 0:
        raise ConfigError(f"--pool-depth must be >= 0 (0: no pool), got {args.pool_depth}")
    if not args.speculate:
        for flag, value, off in (("--pool-depth", args.pool_depth, 0), ("--router", args.router, "off")):
            if value not in (None, off):
                raise ConfigError(f"{flag} {value} needs speculation: a serial run (--no-speculate) makes no forks")
        if args.markov:
            raise ConfigError("--markov is an action drafter: a serial run (--no-speculate) drafts nothing")
    args.metrics = None
    if args.metrics_port is not None:
        from aospec.metrics import Metrics

        try:
            args.metrics = Metrics()
        except AospecError as exc:  # prometheus_client is missing: the install line
            raise ConfigError(f"--metrics-port: {exc}") from None
    if args.router == "trained" and not args.train_traces:
        raise ConfigError("--router trained is fitted on --train-traces: give them, or use --router parse")
    if args.markov and not args.train_traces:
        raise ConfigError("--markov is fitted on --train-traces: give them, or leave --markov out")
    if args.policy != "aospec" or args.drafter_options:
        if not args.speculate:
            raise ConfigError("--policy and --drafter-options choose drafters: a serial run (--no-speculate) drafts nothing")
        from aospec.replay.cli.sweep import _drafter_options
        from aospec.replay.policies import check_drafter_names, parse_policy

        args.drafter_options = _drafter_options(args.drafter_options)
        check_drafter_names([parse_policy(args.policy)])
    from aospec.host import check_budget

    check_budget(args.speculation_budget)
    if args.speculation_budget is not None and not args.speculate:
        raise ConfigError("--speculation-budget needs speculation: a serial run (--no-speculate) makes no forks")
    if args.calibration is not None:
        if not args.speculate:
            raise ConfigError("--calibration is the speculation controller's: a serial run (--no-speculate) has none")
        if Path(args.calibration).is_dir():
            raise ConfigError(f"--calibration {args.calibration} is a directory; give a file name")


def _specbox_options(args: argparse.Namespace) -> Any:
    """The SpecBox layer of the run: what was asked, else the defaults of its mode."""
    from aospec.live.specbox_layer import SpecBoxOptions

    spec = args.speculate
    return SpecBoxOptions(
        cache=args.cache or ("reads" if spec else "off"),
        # Only the cache is on by default: on the live benchmark the pool's forks made ahead
        # and the routed forks cost more CPU than they saved on 2 cores
        # (docs/live-benchmark.md, "With the SpecBox layer"); they are there to be asked for.
        pool_depth=args.pool_depth if args.pool_depth is not None else 0,
        router=args.router or "off",
        markov=bool(args.markov),
    )


def _chat_format(args: argparse.Namespace) -> Any:
    from aospec.live.chat import ChatFormat

    try:
        return ChatFormat.from_files(args.system_template, args.instance_template, action_format=args.action_format)
    except OSError as exc:
        raise ConfigError(f"cannot read a template: {exc}") from None


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    sampling: dict[str, Any] = {"temperature": args.temperature}
    if args.seed is not None:
        sampling["seed"] = args.seed
    if args.max_tokens is not None:
        sampling["max_tokens"] = args.max_tokens
    return sampling


def _actor(args: argparse.Namespace, chat_format: Any) -> Any:
    """OpenAIChatActor for a URL, TransformersActor for a local path."""
    if args.model.startswith(("http://", "https://")):
        from aospec.live.actors import OpenAIChatActor

        key = os.environ.get(args.api_key_env) if args.api_key_env else None
        return OpenAIChatActor(
            args.model,
            args.model_name or "default",
            api_key=key,
            chat_format=chat_format,
            sampling=_sampling(args),
            timeout_s=args.request_timeout,
            retries=args.retries,
        )
    try:
        from aospec.live.local import TransformersActor
    except ImportError as exc:
        raise ConfigError(f"--model {args.model}: a local model needs the train extra (transformers): {exc}") from None
    return TransformersActor(args.model, chat_format=chat_format, sampling=_sampling(args), device=args.device)


def _model_name(args: argparse.Namespace) -> str:
    return args.model_name or (Path(args.model).name if not args.model.startswith(("http://", "https://")) else "default")


def _run(args: argparse.Namespace) -> int:
    import anyio

    try:
        _check_args(args)
        chat_format = _chat_format(args)
        train: list[Any] = []
        if args.train_traces and args.speculate:
            from aospec.replay import load_traces

            train = load_traces(args.train_traces)
        options = _specbox_options(args)
        from aospec.live.specbox_layer import build_router

        args.specbox = options
        args.router_object = build_router(options.router, train)  # one that cannot be built: a usage error
        args.admission_model = _admission_model(args, train)
        actor = _actor(args, chat_format)
    except AospecError as exc:
        _err(str(exc))
        return 2
    state: dict[str, Any] = {}
    try:
        result = anyio.run(_main, args, actor, train, state)
    except KeyboardInterrupt:
        rec = state.get("recorder")
        where = f"; {len(rec.steps)} committed steps are in {rec.path}" if rec is not None else ""
        print(f"aospec: interrupted{where}", file=sys.stderr)
        return 130
    except AospecError as exc:
        _err(str(exc) + _recorded(state))
        return 1
    except Exception as exc:
        _err(f"{type(exc).__name__}: {exc}{_recorded(state)}")
        return 1
    _summary(args, result, state)
    return 0


def _admission_model(args: argparse.Namespace, train: list[Any]) -> Any:
    """The speculation controller's model: ``--calibration FILE`` when it exists, else
    fitted on the training traces by replaying them through the engine (None: learned
    from scratch during the run)."""
    if not args.speculate:
        return None
    from aospec.admission import AdmissionModel

    if args.calibration is not None and Path(args.calibration).exists():
        return AdmissionModel.load(args.calibration)
    if train:
        from aospec.replay.calibrate import fit_admission

        return fit_admission(train)
    return None


def _speculation_budget(args: argparse.Namespace) -> Any:
    """The host's budget of ``--speculation-budget`` (:func:`aospec.host.host_budget`: auto
    where it is not given; None for none); its notes go to stderr."""
    from aospec.host import host_budget

    budget = host_budget(args.speculation_budget)
    for note in budget.notes if budget is not None else ():
        _warn(note)
    return budget


def _budget_text(args: argparse.Namespace) -> str:
    """The budget that applies, as given: ``--speculation-budget``, else
    $AOSPEC_SPECULATION_BUDGET, else ``auto``."""
    from aospec.host import budget_spec

    return budget_spec(args.speculation_budget)[0]


def _explicit_budget(args: argparse.Namespace) -> bool:
    """A budget in cores given on the command line (or $AOSPEC_SPECULATION_BUDGET): only
    then does the run also set the kernel-enforced part (auto is the shared slots alone)."""
    from aospec.host import BUDGET_WORDS

    return _budget_text(args).strip().lower() not in BUDGET_WORDS


@contextlib.contextmanager
def _kernel_budget(budget: Any) -> Iterator[None]:
    """The runtime's kernel-enforced part of the budget (one cgroup for every speculative
    command of the host, with the budget's CPU quota and memory limit:
    :func:`aospec.runtime.set_speculation_budget`), for the run. A budget already set on
    the host (by an operator, ``aospec sandbox budget``, or another run) is kept as it is;
    one this run set is removed when it ends. Where the kernel cannot enforce it, one note
    says so and the shared fork slots are the budget."""
    from aospec.runtime import clear_speculation_budget, set_speculation_budget, speculation_budget

    existing = speculation_budget()
    if existing is not None:
        _warn(
            f"the host already has a speculation budget ({existing.cores or 'unlimited'} cores, "
            f"{existing.memory_bytes or 'unlimited'} bytes): kept as it is"
        )
        yield
        return
    kernel = set_speculation_budget(cores=budget.cores, memory_bytes=budget.memory_bytes)
    if kernel.note:
        _warn(kernel.note)
    try:
        yield
    finally:
        clear_speculation_budget()


def _recorded(state: dict[str, Any]) -> str:
    rec = state.get("recorder")
    return f" ({len(rec.steps)} committed steps recorded in {rec.path})" if rec is not None else ""


async def _main(args: argparse.Namespace, actor: Any, train: list[Any], state: dict[str, Any]) -> Any:
    import contextlib
    import dataclasses

    import anyio
    from aospec.live.agent import OBSERVATION_FORMAT, Agent, default_drafters
    from aospec.live.record import TraceRecorder
    from aospec.live.specbox_layer import open_specbox
    from aospec.runtime import SandboxConfig, open_sandbox

    from aospec.admission import host_config
    from aospec.host import ProcHostMonitor
    from aospec.types import History

    try:
        if args.check_determinism:
            check = getattr(actor, "check_determinism", None)
            if check is None:
                _warn("--check-determinism: this actor cannot check determinism")
            else:
                report = await check(History(args.task))
                if not report.identical:
                    _warn(
                        f"the model's first reply differed between two identical requests (first at character "
                        f"{report.differs_at}): decoding is not deterministic, so speculative runs may differ from "
                        "serial ones (use --temperature 0 and --seed, or a deterministic server)"
                    )
        drafters = default_drafters(train, args.policy, args.drafter_options) if args.speculate else None
        host = budget = None
        kernel_budget: Any = contextlib.nullcontext()
        if drafters is not None:
            host = ProcHostMonitor()
            for note in host.notes:
                _warn(note)
            # host-aware defaults: width, depth and live forks follow the cores and the load now
            drafters = dataclasses.replace(drafters, config=host_config(drafters.config, host.snapshot()))
            budget = _speculation_budget(args)
            if budget is not None and _explicit_budget(args):
                kernel_budget = _kernel_budget(budget)
        config = SandboxConfig(
            backend=args.sandbox,
            base=args.base,
            timeout_s=args.command_timeout,
            read_sets="all" if args.record_read_sets else "auto",
            formatter=OBSERVATION_FORMAT,
        )
        if args.speculate and args.sandbox == "overlay":
            from aospec.runtime.overlay import read_sets_on

            on, why = read_sets_on(config)  # ConfigError with --record-read-sets where it cannot work
            if not on:
                _warn(f"read-set validation {why}: forks are reused only from the committed version (plain JASV)")
        async with (
            _entered(kernel_budget),
            open_sandbox(config) as raw_sandbox,
            open_specbox(raw_sandbox, args.specbox, train, router=args.router_object) as box,
        ):
            sandbox = box.sandbox
            state["specbox"] = box
            if drafters is not None:
                drafters = box.with_drafters(drafters)
            recorder = None
            if args.record is not None:
                recorder = TraceRecorder(
                    args.record,
                    task=args.task,
                    actor_model=_model_name(args),
                    meta={
                        "speculate": args.speculate,
                        "sandbox": args.sandbox,
                        "base": args.base,
                        "model": args.model if args.model.startswith(("http://", "https://")) else _model_name(args),
                        "step_limit": args.step_limit,
                        "speculation_budget": _budget_text(args),
                        "specbox": box.summary(),
                        "version_start": sandbox.version,
                        "exit_reason": "running",
                    },
                )
                state["recorder"] = recorder
            progress = _Progress(enabled=args.progress or sys.stderr.isatty())

            metrics = args.metrics

            def on_step(step: Any, stats: Any) -> None:
                box.observe(step.action)
                if recorder is not None:
                    recorder.add(step, stats)
                progress.update(step, stats)
                if metrics is not None:
                    metrics.step(step.wait_actor_ns + step.wait_tool_ns, step.tool_ns)

            agent = Agent(
                actor,
                sandbox,
                speculate=args.speculate,
                drafters=drafters,
                step_limit=args.step_limit,
                on_step=on_step,
                router=box.router,
                host=host,
                budget=budget,
                admission_model=args.admission_model,
                record_access=args.record_read_sets,
            )
            try:
                with progress:
                    result = await _run_agent(agent, args, actor)
            except BaseException as exc:
                if recorder is not None:
                    cancelled = isinstance(exc, (anyio.get_cancelled_exc_class(), KeyboardInterrupt))
                    recorder.finish(
                        exit_reason="interrupted" if cancelled else "error",
                        error=None if cancelled else f"{type(exc).__name__}: {exc}",
                    )
                raise
            if recorder is not None:
                recorder.meta["specbox"] = box.summary()
                recorder.finish(result)
            state["actor_stats"] = getattr(actor, "stats", None)
            if args.calibration is not None:
                agent.engine.admission_model.save(args.calibration)  # with what this run learned
            return result
    finally:
        close = getattr(actor, "aclose", None)
        if close is not None:
            with anyio.CancelScope(shield=True):
                await close()


@contextlib.asynccontextmanager
async def _entered(manager: Any) -> Any:
    """Enter ``manager``, sync or async (the runtime's kernel budget may be either)."""
    if hasattr(manager, "__aenter__"):
        async with manager as value:
            yield value
    else:
        with manager as value:
            yield value


async def _run_agent(agent: Any, args: argparse.Namespace, actor: Any) -> Any:
    """``agent.run(task)``, with the metrics served meanwhile (``--metrics-port``)."""
    metrics = args.metrics
    if metrics is None:
        return await agent.run(args.task)
    from aospec._http import TOKEN_ENV
    from aospec.metrics import metrics_served

    stats = getattr(actor, "stats", None)  # a chat actor's ActorStats: its requests
    metrics.watch(
        agent.engine.statistics,
        live_forks=agent.engine.live_forks,
        requests=None if stats is None else lambda: stats.requests,
        errors=None if stats is None else lambda: {"model": stats.failed_requests},
    )
    token = os.environ.get(TOKEN_ENV, "").strip() or None
    async with metrics_served(metrics, args.metrics_port, prog="aospec run", token=token):
        try:
            return await agent.run(args.task)
        except Exception:
            metrics.error("run")
            raise


class _Progress:
    """The live progress line on stderr: step, tool time hidden so far, forks reused, drafts
    hit. A terminal gets one line redrawn in place; otherwise (``--progress``) one line per
    step."""

    def __init__(self, *, enabled: bool) -> None:
        from rich.console import Console

        self.enabled = enabled
        self.console = Console(stderr=True)
        self._live: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled and self.console.is_terminal:
            from rich.live import Live
            from rich.text import Text

            self._live = Live(Text("step 0"), console=self.console, transient=True, refresh_per_second=8)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    @staticmethod
    def line(step: Any, stats: Any) -> str:
        cmd = step.action.command if step.action.command is not None else step.action.tool
        cmd = cmd.replace("\n", " ")
        if len(cmd) > 50:
            cmd = cmd[:47] + "..."
        return (
            f"step {step.index + 1} | tool hidden {stats.tool_time_hidden_s:.2f}s of {stats.tool_time_s:.2f}s | "
            f"forks reused {stats.forks_reused} | drafts hit {stats.drafts_hit} | $ {cmd}"
        )

    def update(self, step: Any, stats: Any) -> None:
        if not self.enabled:
            return
        text = self.line(step, stats)
        if self._live is not None:
            from rich.text import Text

            self._live.update(Text(text))
        else:
            print(text, file=sys.stderr, flush=True)


def _summary(args: argparse.Namespace, result: Any, state: dict[str, Any]) -> None:
    data = result.summary()
    rec = state.get("recorder")
    data["record"] = str(rec.path) if rec is not None else None
    data["trace_id"] = rec.id if rec is not None else None
    stats = state.get("actor_stats")
    if stats is not None and hasattr(stats, "to_json"):
        data["actor"] = stats.to_json()
    box = state.get("specbox")
    data["specbox"] = box.summary() if box is not None else None
    if args.format == "json":
        print_json(data)
        return
    from rich.table import Table

    table = Table(title=f"aospec run ({'speculative' if result.speculate else 'serial'})", show_header=False)
    table.add_column("figure")
    table.add_column("value", overflow="fold")
    rows = [
        ("exit", result.exit_reason),
        ("steps", str(data["steps"])),
        ("wall time", f"{data['wall_s']:.3f} s"),
        ("decode / tool time", f"{data['decode_s']:.3f} s / {data['tool_s']:.3f} s"),
        ("tool time hidden", f"{data['tool_hidden_s']:.3f} s"),
        ("decode time hidden", f"{data['decode_hidden_s']:.3f} s"),
        ("overhead", f"{data['overhead_s']:.3f} s"),
        ("forks reused / launched", f"{data['forks_reused']} / {data['forks_launched']}"),
        ("drafts hit / started", f"{data['drafts_hit']} / {data['drafts_started']}"),
        ("speculative failures", str(data["speculative_failures"])),
        *_admission_rows(data, result.speculate),
        *_specbox_rows(data),
        ("final version", data["final_version"]),
    ]
    if data["record"]:
        rows.append(("recorded", data["record"]))
    for k, v in rows:
        table.add_row(k, v)
    print_table(table)


def _admission_rows(data: dict[str, Any], speculate: bool) -> list[tuple[str, str]]:
    """The summary table's rows of the speculation controller (speculative runs only)."""
    if not speculate:
        return []
    a = data["admission"]
    refused = a["refused"]
    eff = data["efficiency"]
    rows = [
        (
            "wasted CPU (efficiency)",
            f"{data['wasted_cpu_s']:.3f} s ({'-' if eff is None else f'{eff:.2f}'} tool s hidden per CPU-s)",
        ),
        (
            "guesses launched / refused",
            f"{a['launched']} / {sum(refused.values())} (price {refused['price']}, guard {refused['guard']}, "
            f"budget {refused['budget']}, memory {refused['memory']}; probes {a['probes']})",
        ),
    ]
    if data["forks_paused"] or data["forks_dropped"]:
        rows.append(
            (
                "forks paused (time) / dropped",
                f"{data['forks_paused']} ({data['paused_s']:.3f} s) / {data['forks_dropped']}",
            )
        )
    return rows


def _specbox_rows(data: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary table's rows of the SpecBox layer (only the parts the run used)."""
    box = data.get("specbox") or {}
    rows: list[tuple[str, str]] = []
    cache = data.get("cache")
    if cache is not None:
        rows.append(
            (
                "cache hits / misses / bypasses",
                f"{cache['hits']} / {cache['misses']} / {cache['bypasses']} (stale avoided {cache['stale_avoided']})",
            )
        )
        rows.append(("cache hits committed (saved)", f"{data['cache_hits']} ({data['cache_saved_s']:.3f} s)"))
    if box.get("router", "off") != "off":
        rows.append(("routes fired", str(data["routes_fired"])))
        rows.append(
            ("routed forks reused / launched", f"{data['routed_forks_reused']} / {data['routed_forks_launched']}")
        )
    pool = box.get("pool")
    if pool is not None:
        rows.append(("pool forks served / made", f"{pool['served']} / {pool['made']}"))
    return rows
