"""The seccomp filter of the overlay backend's commands (bubblewrap's ``--seccomp``).

``SandboxConfig.seccomp`` is ``default`` (the filter below), ``none``, or the path of a
JSON profile in a subset of Docker's format. The filter is compiled to BPF by libseccomp
(through the ``pyseccomp`` ctypes binding), never written by hand, and compiled once per
profile and process.

The default filter follows Docker's default profile for a container without
CAP_SYS_ADMIN: it allows everything but what that profile refuses, which fails with
EPERM (the process is not killed). ``clone3`` fails with ENOSYS instead, so that the C
library falls back to ``clone``, whose flags a filter can read (as Docker does).
A profile file looks like this (every key optional but ``syscalls``)::

    {"defaultAction": "SCMP_ACT_ALLOW",
     "syscalls": [{"names": ["keyctl", "add_key"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
                  {"names": ["clone"], "action": "SCMP_ACT_ERRNO",
                   "args": [{"index": 0, "value": 268435456, "valueTwo": 268435456,
                             "op": "SCMP_CMP_MASKED_EQ"}]}]}

Actions: ``SCMP_ACT_ALLOW``, ``SCMP_ACT_ERRNO`` (``errnoRet``, default EPERM),
``SCMP_ACT_KILL_PROCESS``, ``SCMP_ACT_KILL_THREAD``/``SCMP_ACT_KILL``, ``SCMP_ACT_LOG``,
``SCMP_ACT_TRAP``; ``defaultErrnoRet`` for an ``SCMP_ACT_ERRNO`` default. ``architectures``
(``SCMP_ARCH_X86`` ...) replaces the default set (the native one plus its 32-bit ABIs).
Docker's ``includes``/``excludes`` are not read: resolve them for your capabilities first.
Syscall names this libseccomp does not know are skipped, as Docker does.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aospec.errors import ConfigError, SandboxUnavailableError

__all__ = ["BLOCKED", "default_profile", "filter_program", "seccomp_support"]

# refused with EPERM (Docker's default profile without CAP_SYS_ADMIN, CAP_SYS_BOOT,
# CAP_SYS_MODULE, CAP_SYS_PACCT, CAP_SYS_PTRACE, CAP_SYS_RAWIO, CAP_SYS_TIME,
# CAP_SYS_NICE, CAP_SYSLOG, CAP_SYS_TTY_CONFIG, CAP_DAC_READ_SEARCH, CAP_BPF, CAP_PERFMON)
BLOCKED = (
    # kernel keyrings
    "add_key", "keyctl", "request_key",
    # mounting, namespaces and the root directory
    "mount", "umount", "umount2", "pivot_root", "unshare", "setns",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    # kernel modules, kexec, reboot, swap, accounting, quotas
    "init_module", "finit_module", "delete_module", "create_module", "query_module", "get_kernel_syms",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd",
    # clocks and host names
    "clock_settime", "clock_adjtime", "settimeofday", "stime", "sethostname", "setdomainname",
    # BPF, perf, userfaultfd, io_uring
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    # file handles, other processes' memory
    "open_by_handle_at", "name_to_handle_at", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # NUMA policy, raw I/O ports, obsolete or host-global calls
    "mbind", "set_mempolicy", "set_mempolicy_home_node", "get_mempolicy", "move_pages",
    "ioperm", "iopl", "vm86", "vm86old", "lookup_dcookie", "nfsservctl", "sysfs", "_sysctl",
    "syslog", "uselib", "ustat", "vhangup", "fanotify_init",
)  # fmt: skip

# clone with any of these flags (a new namespace) is refused: CLONE_NEWTIME, CLONE_NEWNS,
# CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET
_CLONE_NAMESPACES = (0x80, 0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
# personality(2) values Docker allows: PER_LINUX, PER_LINUX32, UNAME26, and the query
_PERSONALITY_BITS = (0x8, 0x20000)
_PERSONALITY_QUERY = 0xFFFFFFFF

_ACTIONS = {
    "SCMP_ACT_ALLOW",
    "SCMP_ACT_ERRNO",
    "SCMP_ACT_KILL",
    "SCMP_ACT_KILL_THREAD",
    "SCMP_ACT_KILL_PROCESS",
    "SCMP_ACT_LOG",
    "SCMP_ACT_TRAP",
}
_OPS = ("SCMP_CMP_NE", "SCMP_CMP_LT", "SCMP_CMP_LE", "SCMP_CMP_EQ", "SCMP_CMP_GE", "SCMP_CMP_GT", "SCMP_CMP_MASKED_EQ")


def _masked(value: int, mask: int) -> dict[str, Any]:
    return {"index": 0, "op": "SCMP_CMP_MASKED_EQ", "value": mask, "valueTwo": value}


def default_profile() -> dict[str, Any]:
    """The default filter as a profile (the format a ``seccomp`` file uses)."""
    eperm = {"action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}
    rules: list[dict[str, Any]] = [{"names": list(BLOCKED), **eperm}]
    rules += [{"names": ["clone"], **eperm, "args": [_masked(flag, flag)]} for flag in _CLONE_NAMESPACES]
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS})
    # personality: refuse every value but 0, 8, 0x20000 and 0xffffffff. One argument
    # comparison per rule (a libseccomp rule cannot compare an argument twice), rules
    # OR-ed, low 32 bits only (the kernel reads an unsigned int):
    top = 0x80000000
    # bit 31 set and any lower bit clear: a value with bit 31 that is not the query
    rules += [{"names": ["personality"], **eperm, "args": [_masked(top, top | 1 << k)]} for k in range(31)]
    # bit 31 clear and a bit other than those of PER_LINUX32 and UNAME26 set
    allowed = functools.reduce(lambda a, b: a | b, _PERSONALITY_BITS)
    rules += [
        {"names": ["personality"], **eperm, "args": [_masked(1 << k, top | 1 << k)]}
        for k in range(31)
        if not allowed & 1 << k
    ]
    # bit 31 clear, both allowed bits set
    rules.append({"names": ["personality"], **eperm, "args": [_masked(allowed, top | allowed)]})
    return {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": rules}


def _library() -> Any:
    try:
        import pyseccomp
    except ImportError:
        raise SandboxUnavailableError(
            "the seccomp filter needs the pyseccomp package (pip install pyseccomp) and libseccomp "
            "(apt-get install libseccomp2); or set seccomp: none"
        ) from None
    except (OSError, RuntimeError) as exc:
        raise SandboxUnavailableError(
            f"the seccomp filter needs libseccomp ({exc}): apt-get install libseccomp2; or set seccomp: none"
        ) from None
    return pyseccomp


def seccomp_support() -> str:
    """``available (libseccomp X.Y.Z, N syscalls refused)`` or ``unavailable: why``."""
    try:
        lib = _library()
        program = filter_program("default")
    except SandboxUnavailableError as exc:
        return f"unavailable: {exc}"
    version = "?"
    with_version = getattr(lib, "_libseccomp", None)
    if with_version is not None and hasattr(with_version, "seccomp_version"):
        import ctypes

        class _Version(ctypes.Structure):
            _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint)]

        with_version.seccomp_version.restype = ctypes.POINTER(_Version)
        v = with_version.seccomp_version().contents
        version = f"{v.major}.{v.minor}.{v.micro}"
    return f"available (libseccomp {version}, default filter {len(program) // 8} BPF instructions)"


def filter_program(spec: str) -> bytes | None:
    """The compiled BPF program of ``spec`` (``default``, ``none`` or a profile path);
    None for ``none``. Raises ConfigError for a bad profile, SandboxUnavailableError
    when libseccomp is missing."""
    if spec == "none":
        return None
    if spec == "default":
        return _compiled("default", 0, 0)
    path = Path(spec)
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError(f"seccomp profile {spec}: {exc.strerror}") from None
    return _compiled(str(path.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _compiled(spec: str, mtime_ns: int, size: int) -> bytes:
    if spec == "default":
        return _compile(default_profile(), where="the default seccomp profile")
    try:
        profile = json.loads(Path(spec).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"seccomp profile {spec}: not readable JSON ({exc})") from None
    return _compile(profile, where=f"seccomp profile {spec}")


def _action(lib: Any, rule: Mapping[str, Any], key: str, errno_key: str, where: str) -> int:
    name = rule.get(key, "SCMP_ACT_ERRNO" if key == "action" else "SCMP_ACT_ALLOW")
    if name not in _ACTIONS:
        raise ConfigError(f"{where}: {key} {name!r} is not one of {', '.join(sorted(_ACTIONS))}")
    if name == "SCMP_ACT_ERRNO":
        ret = rule.get(errno_key, errno.EPERM)
        if not isinstance(ret, int) or not 0 < ret < 4096:
            raise ConfigError(f"{where}: {errno_key} must be an errno number, got {ret!r}")
        return int(lib.ERRNO(ret))
    return {
        "SCMP_ACT_ALLOW": lib.ALLOW,
        "SCMP_ACT_KILL": lib.KILL_THREAD,
        "SCMP_ACT_KILL_THREAD": lib.KILL_THREAD,
        "SCMP_ACT_KILL_PROCESS": lib.KILL_PROCESS,
        "SCMP_ACT_LOG": lib.LOG,
        "SCMP_ACT_TRAP": lib.TRAP,
    }[name]


def _check_keys(obj: Any, allowed: set[str], where: str) -> None:
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{where}: expected an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        hint = " (resolve Docker's includes/excludes first)" if {"includes", "excludes"} & set(unknown) else ""
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}{hint}")


_SECONDARY_ARCHES = {"X86_64": ("X86", "X32"), "AARCH64": ("ARM",)}


def _compile(profile: Any, *, where: str) -> bytes:
    lib = _library()
    _check_keys(profile, {"defaultAction", "defaultErrnoRet", "architectures", "syscalls", "comment"}, where)
    default = _action(lib, profile, "defaultAction", "defaultErrnoRet", where)
    flt = lib.SyscallFilter(default)
    native = lib.system_arch()
    native_name = next((n for n in dir(lib.Arch) if n != "NATIVE" and getattr(lib.Arch, n) == native), "")
    if "architectures" in profile:
        arches = []
        for a in profile["architectures"]:
            if not isinstance(a, str) or not hasattr(lib.Arch, a.removeprefix("SCMP_ARCH_")):
                raise ConfigError(f"{where}: unknown architecture {a!r}")
            arches.append(a.removeprefix("SCMP_ARCH_"))
    else:
        arches = [native_name, *_SECONDARY_ARCHES.get(native_name, ())]
    for arch_name in arches:
        arch = getattr(lib.Arch, arch_name)
        if arch != native and not flt.exist_arch(arch):
            flt.add_arch(arch)
    rules = profile.get("syscalls", [])
    if not isinstance(rules, list):
        raise ConfigError(f"{where}: syscalls must be a list")
    for i, rule in enumerate(rules):
        at = f"{where}: syscalls[{i}]"
        _check_keys(rule, {"names", "name", "action", "errnoRet", "args", "comment"}, at)
        action = _action(lib, rule, "action", "errnoRet", at)
        args = []
        for j, a in enumerate(rule.get("args") or []):
            _check_keys(a, {"index", "value", "valueTwo", "op"}, f"{at}.args[{j}]")
            if a.get("op") not in _OPS or not isinstance(a.get("index"), int) or not 0 <= a["index"] < 6:
                raise ConfigError(f"{at}.args[{j}]: needs index 0-5 and op one of {', '.join(_OPS)}")
            op = getattr(lib, a["op"].removeprefix("SCMP_CMP_"))
            args.append(lib.Arg(a["index"], op, int(a.get("value", 0)), int(a.get("valueTwo", 0))))
        names = rule.get("names") or ([rule["name"]] if "name" in rule else [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"{at}: names must be a list of syscall names")
        for name in names:
            if lib.resolve_syscall(lib.Arch.NATIVE, name) == -1:
                continue  # a syscall this libseccomp does not know
            try:
                flt.add_rule(action, name, *args)
            except OSError as exc:
                raise ConfigError(f"{at}: libseccomp refused the rule for {name!r} ({exc.strerror})") from None
    with tempfile.TemporaryFile() as f:
        flt.export_bpf(f)
        f.seek(0)
        return f.read()


def program_fd(program: bytes) -> int:
    """A readable pipe holding ``program`` (what bwrap's ``--seccomp FD`` reads)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        if len(program) > 65536:
            raise SandboxUnavailableError("the seccomp program is larger than a pipe buffer (64 KiB)")
        os.write(w, program)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r
