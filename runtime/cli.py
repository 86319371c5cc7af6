"""``aospec sandbox``: build bases, run a command in a fresh sandbox, inspect the host, verify
a persistent state directory, gc, the host's speculation budget."""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
from typing import Any

from aospec.cli._common import add_alias, add_format_option, print_fields, print_json
from aospec.errors import ConfigError

__all__ = ["register"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``512M``, ``2G``, ``1048576`` -> bytes (powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (use e.g. 512M or 2G)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sandbox",
        help="copy-on-write sandboxes (runtime/)",
        description="Build bases, run a command in a fresh sandbox, inspect the host, clean up after killed sessions.",
    )
    sub = p.add_subparsers(dest="sandbox_command", required=True, metavar="SUBCOMMAND")

    b = sub.add_parser("build-base", help="build and cache a base filesystem")
    b.add_argument(
        "spec", nargs="?", default="busybox", help="busybox (default), debootstrap[:SUITE][+PKG,...] or image:NAME"
    )
    b.add_argument("--force", action="store_true", help="rebuild even when cached")
    b.add_argument("--suite", default="bookworm", help="Debian suite for debootstrap (default bookworm)")
    b.add_argument("--mirror", default=None, help="Debian mirror URL for debootstrap")
    b.add_argument(
        "--include",
        default=None,
        metavar="PKG,...",
        help="extra Debian packages for debootstrap (its --include); the base is then named "
        "debootstrap:SUITE+PKG,... (e.g. --base debootstrap:bookworm+python3,gcc,make)",
    )
    b.add_argument("--docker", action="store_true", help="also import it as a Docker image")
    add_format_option(b)
    b.set_defaults(func=_build_base)

    e = sub.add_parser(
        "exec",
        help="run one command in a fresh sandbox (same isolation defaults as the engine)",
        description="Run CMD in a fresh sandbox and print its output; the exit status is the command's "
        "(124 on timeout). Example: aospec sandbox exec -- ls -la /",
    )
    e.add_argument("--backend", default="overlay", help="overlay (default), docker, or a dotted path")
    e.add_argument(
        "--base", default="busybox", help="base: busybox, debootstrap[:SUITE][+PKG,...], image:NAME or a directory"
    )
    e.add_argument("--network", action="store_true", help="allow network access (default: none)")
    e.add_argument(
        "--command-timeout", dest="timeout", type=float, default=30.0, help="seconds before the command is killed (default 30)"
    )
    add_alias(e, "--timeout", "--command-timeout")
    e.add_argument("--workdir", default="/", help="working directory inside the sandbox")
    e.add_argument("--env", action="append", default=[], metavar="K=V", help="environment variable (repeatable)")
    e.add_argument("--bind", action="append", default=[], metavar="SRC:DST[:rw]", help="bind a host path (repeatable)")
    e.add_argument("--memory", type=parse_size, help="memory limit (e.g. 1G)")
    e.add_argument("--cpus", type=float, help="CPU limit (cores)")
    e.add_argument("--pids", type=int, help="process-count limit")
    e.add_argument("--disk", type=parse_size, help="limit on what the sandbox may write (e.g. 2G)")
    e.add_argument("--state-dir", default=None, help="persistent state directory (default: a private one)")
    e.add_argument(
        "--seccomp", default="default", help="syscall filter: default, none, or a JSON profile (overlay backend)"
    )
    add_format_option(e)
    e.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...] (one argument: a shell command line)")
    e.set_defaults(func=_exec)

    i = sub.add_parser("info", help="what this host supports: overlayfs, bubblewrap, cgroups, Docker, CRIU")
    add_format_option(i)
    i.set_defaults(func=_info)

    v = sub.add_parser(
        "verify",
        help="check that a persistent state directory still holds the state its version names",
        description="Re-hash a closed persistent overlay state directory (its base and every layer on disk) and "
        "compare with what HEAD recorded. Prints 'ok VERSION' and exits 0, or names what differs and exits 1.",
    )
    v.add_argument("state", help="the state directory (SandboxConfig.state_dir)")
    add_format_option(v)
    v.set_defaults(func=_verify)

    g = sub.add_parser(
        "gc", help="remove what sandbox sessions that died left: mounts, dirs, cgroups, orphaned processes, containers"
    )
    g.add_argument(
        "--state-root",
        default=None,
        help="where private state dirs live (default $AOSPEC_STATE_ROOT or /var/tmp/aospec)",
    )
    g.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    add_format_option(g)
    g.set_defaults(func=_gc)

    sb = sub.add_parser(
        "budget",
        help="show or set the host's speculation budget (CPU and memory of every session's guesses)",
        description="With no option, print the host's speculation budget. --cores and --memory set it (an omitted "
        "one is unlimited): every aospec session on this host then runs its background (speculative) commands "
        "in one cgroup under that CPU quota and memory limit, until --clear.",
    )
    sb.add_argument("--cores", type=float, help="CPUs all speculation of the host may use (e.g. 1.5)")
    sb.add_argument("--memory", type=parse_size, help="memory all speculation of the host may hold (e.g. 4G)")
    sb.add_argument("--clear", action="store_true", help="remove the budget")
    add_format_option(sb)
    sb.set_defaults(func=_budget)


def _build_base(args: argparse.Namespace) -> int:
    from aospec.runtime.bases import build_base

    base = build_base(args.spec, force=args.force, suite=args.suite, mirror=args.mirror, include=args.include)
    out: dict[str, Any] = base.to_json()
    if args.spec.startswith("debootstrap"):
        from aospec.runtime.bases import parse_debootstrap_spec

        suite, packages = parse_debootstrap_spec(args.spec, suite=args.suite, include=args.include)
        out["spec"] = f"debootstrap:{suite}" + ("+" + ",".join(packages) if packages else "")
    if args.docker:
        from aospec.runtime.daemon import docker_client
        from aospec.runtime.docker import ensure_base_image

        client = docker_client()
        try:
            out["docker_image"] = ensure_base_image(client, base)
        finally:
            client.close()
    print_fields(out, args.format, width=13)
    return 0


def _exec(args: argparse.Namespace) -> int:
    import anyio
    from aospec.runtime import Bind, Limits, SandboxConfig, open_sandbox


    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError("no command given; usage: aospec sandbox exec [OPTIONS] -- CMD [ARGS...]")
    command = cmd[0] if len(cmd) == 1 else shlex.join(cmd)
    env = {}
    for item in args.env:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ConfigError(f"--env {item!r}: expected K=V")
        env[k] = v
    for flag, value in (
        ("--command-timeout", args.timeout),
        ("--memory", args.memory),
        ("--cpus", args.cpus),
        ("--pids", args.pids),
        ("--disk", args.disk),
    ):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} must be a positive number, got {value!r}")
    defaults = Limits()
    try:
        limits = Limits(
            memory_bytes=args.memory if args.memory is not None else defaults.memory_bytes,
            cpus=args.cpus if args.cpus is not None else defaults.cpus,
            pids=args.pids if args.pids is not None else defaults.pids,
            disk_bytes=args.disk if args.disk is not None else defaults.disk_bytes,
        )
        config = SandboxConfig(
            backend=args.backend,
            base=args.base,
            state_dir=args.state_dir,
            network=args.network,
            limits=limits,
            timeout_s=args.timeout,
            workdir=args.workdir,
            env=env,
            binds=tuple(Bind.parse(b) for b in args.bind),
            seccomp=args.seccomp,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    async def main() -> tuple[Any, str, str]:
        async with open_sandbox(config) as sb:
            before = sb.version
            result = await sb.run(command)
            return result, before, sb.version

    # SIGTERM and SIGHUP clean up as Ctrl-C does: the dispatcher runs every verb under
    # aospec.signals.interrupt_on_signals()
    result, before, after = anyio.run(main)
    if args.format == "json":
        print_json(
            {
                "backend": args.backend,
                "command": command,
                "returncode": result.returncode,
                "output": result.output,
                "timed_out": result.timed_out,
                "duration_s": round(result.duration_s, 6),
                "limits_hit": list(result.limits_hit),
                "version_before": before,
                "version_after": after,
            }
        )
    else:
        sys.stdout.write(result.output)
        sys.stdout.flush()
        extra = f", limits hit: {', '.join(result.limits_hit)}" if result.limits_hit else ""
        print(
            f"[{args.backend}: exit {result.returncode}{' (timed out)' if result.timed_out else ''}, "
            f"{result.duration_s * 1000:.1f} ms, version {before[:12]} -> {after[:12]}{extra}]",
            file=sys.stderr,
        )
    if result.timed_out:
        return 124
    return result.returncode if 0 <= result.returncode < 256 else 1


def _info(args: argparse.Namespace) -> int:
    from aospec.runtime.config import Limits, SandboxConfig
    from aospec.runtime.host import host_support
    from aospec.runtime.overlay import read_sets_on
    from aospec.runtime.seccomp import seccomp_support

    support, _ = host_support()
    out: dict[str, Any] = {
        "root": support.root,
        "overlayfs": support.overlayfs,
        "bwrap": support.bwrap,
        "cgroup_version": support.cgroup_version,
        "cgroup_controllers": list(support.cgroup_controllers),
        "overlay_backend": "ok" if not support.problems() else "; ".join(support.problems()),
        "limits_not_enforced": support.unenforced(Limits(), SandboxConfig().memory_budget_bytes),
        "memory_budget": (
            f"enforced per session and sandbox (cgroup v{support.cgroup_version})"
            if "memory" in support.cgroup_controllers
            else "not enforced: no writable memory cgroup (host memory held by sandboxes is not bounded)"
        ),
        "seccomp": seccomp_support(),
        "pause": (
            f"cgroup freezer (cgroup v{support.cgroup_version})"
            if "freezer" in support.cgroup_controllers
            else "unavailable: no writable freezer cgroup (PausableSandbox.pause() only sets the flag)"
        ),
        "cpu_metering": (
            f"per command cgroup (cgroup v{support.cgroup_version})"
            if "cpuacct" in support.cgroup_controllers
            else "unavailable: no CPU accounting cgroup (MeteredSandbox.cpu_ns stays 0)"
        ),
        "read_sets": read_sets_on(SandboxConfig())[1],
    }
    try:
        from aospec.runtime.daemon import checkpoint_support, docker_client

        client = docker_client()
        try:
            info = client.info()
            ok, why = checkpoint_support(client)
        finally:
            client.close()
        out["docker"] = f"ok (server {info.get('ServerVersion')}, storage driver {info.get('Driver')})"
        out["docker_checkpoint"] = "available" if ok else f"unavailable: {why}"
    except Exception as exc:
        out["docker"] = f"unavailable: {exc}"
    print_fields(out, args.format, width=20)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from aospec.runtime.overlay import verify_state_dir

    check = verify_state_dir(args.state)
    if args.format == "json":
        print_json(
            {
                "state_dir": check.state_dir,
                "ok": check.ok,
                "version": check.version,
                "base": check.base,
                "layers": check.layers,
                "problems": list(check.problems),
            }
        )
    elif check.ok:
        print(f"ok {check.version}")
    else:
        print(f"mismatch {check.state_dir} (version {check.version}):")
        for problem in check.problems:
            print(f"  {problem}")
    return 0 if check.ok else 1


def _gc(args: argparse.Namespace) -> int:
    from pathlib import Path

    from aospec.runtime.gc import collect_garbage

    report = collect_garbage(Path(args.state_root) if args.state_root else None, dry_run=args.dry_run)
    if args.format == "json":
        print_json(report.to_json())
    else:
        verb = "would remove" if args.dry_run else "removed"
        for k, v in report.to_json().items():
            label = k.replace("_", " ")
            print(
                f"{label:15} {len(v):4d}  ({verb if k != 'skipped_in_use' else 'in use'})"
                + "".join(f"\n    {x}" for x in v)
            )
    return 0


def _budget(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from aospec.runtime.budget import clear_speculation_budget, set_speculation_budget, speculation_budget

    if args.clear:
        clear_speculation_budget()
        budget = speculation_budget()
    elif args.cores is not None or args.memory is not None:
        budget = set_speculation_budget(cores=args.cores, memory_bytes=args.memory)
    else:
        budget = speculation_budget()
    if budget is None:
        out: dict[str, Any] = {"budget": "none (speculation is limited by each session's engine only)"}
    else:
        out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(budget).items()}
        out["cores"] = "unlimited" if budget.cores is None else budget.cores
        out["memory_bytes"] = "unlimited" if budget.memory_bytes is None else budget.memory_bytes
    print_fields(out, args.format, width=18)
    return 0
