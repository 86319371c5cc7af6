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

__all__ = [
    "BLOCKED",
    "bind_rules",
    "default_profile",
    "docker_profile",
    "filter_program",
    "no_network_rules",
    "sandbox_rules",
    "seccomp_support",
]

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


_SETID = (0o4000, 0o2000)  # S_ISUID, S_ISGID
_IFMT, _IFCHR, _IFBLK = 0o170000, 0o020000, 0o060000
# where each call takes the mode of the file it creates or changes (argument index)
_MODE_ARG = {"chmod": 1, "fchmod": 1, "fchmodat": 2, "fchmodat2": 2, "creat": 1, "open": 2, "openat": 3}
_MKNOD_MODE_ARG = {"mknod": 1, "mknodat": 2}
_AF_VSOCK = 40


def _masked_at(index: int, value: int, mask: int) -> dict[str, Any]:
    return {"index": index, "op": "SCMP_CMP_MASKED_EQ", "value": mask, "valueTwo": value}


def bind_rules() -> list[dict[str, Any]]:
    """What a sandbox with a writable bind may not do, anywhere (a filter cannot tell a
    bind from the sandbox's own files): give a file a set-user-ID or set-group-ID bit
    (``chmod``, ``fchmod``, ``fchmodat``, ``fchmodat2``; ``open``, ``openat``, ``creat``
    and ``mknod`` with such a mode) or make a device node (EPERM), or call ``openat2``,
    whose mode a filter cannot read (ENOSYS: callers fall back to ``openat``). With the
    capabilities that could still do it refused (:data:`aospec.runtime.config.BIND_UNSAFE_CAPS`),
    nothing a command writes on a bind can carry privilege out to the host."""
    eperm = {"action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}
    rules = [
        {"names": [name], **eperm, "args": [_masked_at(index, bit, bit)]}
        for name, index in {**_MODE_ARG, **_MKNOD_MODE_ARG}.items()
        for bit in _SETID
    ]
    rules += [
        {"names": [name], **eperm, "args": [_masked_at(index, kind, _IFMT)]}
        for name, index in _MKNOD_MODE_ARG.items()
        for kind in (_IFCHR, _IFBLK)
    ]
    rules.append({"names": ["openat2"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS})
    return rules


def no_network_rules() -> list[dict[str, Any]]:
    """What a sandbox without network may not do: create an ``AF_VSOCK`` socket
    (EAFNOSUPPORT). vsock is not network-namespaced: on a virtual machine it reaches the
    hypervisor and the host's services. (32-bit programs that create sockets through
    ``socketcall``, whose arguments a filter cannot read, get EAFNOSUPPORT for every
    family.)"""
    return [
        {
            "names": ["socket"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": errno.EAFNOSUPPORT,
            "args": [{"index": 0, "op": "SCMP_CMP_EQ", "value": _AF_VSOCK}],
        }
    ]


def sandbox_rules(*, network: bool, writable_binds: bool) -> list[dict[str, Any]]:
    """The rules added to every profile (the default one, a file) for a sandbox's
    configuration: :func:`no_network_rules` unless ``network``, :func:`bind_rules` with
    ``writable_binds``."""
    return ([] if network else no_network_rules()) + (bind_rules() if writable_binds else [])


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


def filter_program(spec: str, *, network: bool = False, writable_binds: bool = False) -> bytes | None:
    """The compiled BPF program of ``spec`` (``default``, ``none`` or a profile path) with
    the rules of :func:`sandbox_rules` added; None for ``none``. Raises ConfigError for a
    bad profile (or one libseccomp cannot combine with those rules),
    SandboxUnavailableError when libseccomp is missing."""
    if spec == "none":
        return None
    if spec == "default":
        return _compiled("default", 0, 0, network, writable_binds)
    path = Path(spec)
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError(f"seccomp profile {spec}: {exc.strerror}") from None
    return _compiled(str(path.resolve()), st.st_mtime_ns, st.st_size, network, writable_binds)


def docker_profile(spec: str, *, network: bool, writable_binds: bool) -> str | None:
    """The seccomp profile (JSON text) a Docker container of this configuration runs
    under: the same filter as the overlay backend's (``default``, or the profile file,
    with :func:`sandbox_rules`); None for ``none`` (Docker's own default profile). It is
    compiled here once, so that a bad profile is the same ConfigError on both backends."""
    if spec == "none":
        return None
    filter_program(spec, network=network, writable_binds=writable_binds)
    profile = default_profile() if spec == "default" else json.loads(Path(spec).read_text())
    extra = sandbox_rules(network=network, writable_binds=writable_binds)
    profile = {**profile, "syscalls": [*profile.get("syscalls", []), *extra]}
    if "architectures" not in profile:
        native = os.uname().machine
        profile["architectures"] = {
            "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
            "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
        }.get(native, [])
    return json.dumps(profile)


@functools.lru_cache(maxsize=32)
def _compiled(spec: str, mtime_ns: int, size: int, network: bool, writable_binds: bool) -> bytes:
    extra = sandbox_rules(network=network, writable_binds=writable_binds)
    if spec == "default":
        return _compile(default_profile(), where="the default seccomp profile", extra=extra)
    try:
        profile = json.loads(Path(spec).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"seccomp profile {spec}: not readable JSON ({exc})") from None
    return _compile(profile, where=f"seccomp profile {spec}", extra=extra)


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


def _compile(profile: Any, *, where: str, extra: list[dict[str, Any]] | None = None) -> bytes:
    """Compile ``profile`` and then aospec's own ``extra`` rules (which must all apply:
    an unknown syscall among them, or a profile rule that conflicts with one, is an
    error, never a silently missing rule)."""
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
    own = len(rules)
    for i, rule in enumerate([*rules, *(extra or [])]):
        at = f"{where}: syscalls[{i}]" if i < own else f"{where}, with aospec's sandbox rule {rule['names']}"
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
                if i >= own:
                    raise SandboxUnavailableError(
                        f"this libseccomp does not know the syscall {name!r}, which aospec's filter must cover: "
                        "upgrade libseccomp2"
                    )
                continue  # a syscall this libseccomp does not know
            try:
                flt.add_rule(action, name, *args)
            except OSError as exc:
                hint = "" if i < own else " (the profile allows it outright; leave it to the default action)"
                raise ConfigError(f"{at}: libseccomp refused the rule for {name!r} ({exc.strerror}){hint}") from None
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
