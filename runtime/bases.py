"""Base filesystems: the read-only bottom of every sandbox.

A base is a directory tree plus its version (the hash of the whole tree, computed once).
Kinds, by the spec string a config names:

``busybox``           built offline from busybox-static, plus the host's bash and its
                      libraries (so ``bash`` actions run); a few MB, about a second.
``debootstrap[:SUITE][+PKG,...]`` a Debian ``--variant=minbase`` tree (needs a Debian mirror),
                      with the extra packages after ``+`` (debootstrap's ``--include``),
                      e.g. ``debootstrap:bookworm+python3,gcc,make``; each package set is
                      its own cached base (``debootstrap_name``).
``image:NAME``        a Docker image exported to a directory.
a directory path      used as it is (never written).

Built bases are cached under ``$AOSPEC_CACHE_DIR/bases/<name>/`` (default
``~/.cache/aospec``; ``bases/`` is kept at mode 0700); ``aospec sandbox build-base``
builds them explicitly.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from aospec.runtime._fs import remove_tree
from aospec.runtime.versions import base_version, tree_layer

from aospec.errors import SandboxError, SandboxUnavailableError

__all__ = [
    "BaseFS",
    "build_base",
    "build_busybox_base",
    "build_debootstrap_base",
    "cache_dir",
    "debootstrap_name",
    "parse_debootstrap_spec",
    "export_image_base",
    "open_base",
]

_META = "base.json"


def cache_dir() -> Path:
    """Where built bases are cached: ``$AOSPEC_CACHE_DIR`` or ``~/.cache/aospec``."""
    env = os.environ.get("AOSPEC_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "aospec"


@dataclass(frozen=True, slots=True)
class BaseFS:
    """A base filesystem: ``path`` is the root of the tree, ``version`` its version."""

    name: str
    path: Path
    version: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "path": str(self.path), "version": self.version}


def _bases_dir() -> Path:
    """``cache_dir()/bases``, made private (0700) when this user owns it: image and
    debootstrap bases hold setuid-root binaries (``su``, ``passwd``, ``mount``) and a
    world-writable ``/tmp``, which no other host user may reach."""
    d = cache_dir() / "bases"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(d)
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.chmod(d, 0o700)
    return d


def _tree_version(root: Path) -> str:
    return base_version(tree_layer(root).digest)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cached(name: str) -> BaseFS | None:
    d = _bases_dir() / name
    meta = d / _META
    if not meta.is_file() or not (d / "rootfs").is_dir():
        return None
    data = json.loads(meta.read_text())
    return BaseFS(name, d / "rootfs", data["version"])


def _install(name: str, kind: str, build, *, force: bool, **extra: object) -> BaseFS:
    """Build into a temporary directory and rename it into the cache (atomic)."""
    bases = _bases_dir()
    with _locked(bases / f".{name}.lock"):
        if not force and (found := _cached(name)) is not None:
            return found
        tmp = bases / f".tmp-{name}-{secrets.token_hex(4)}"
        tmp.mkdir(parents=True)
        try:
            rootfs = tmp / "rootfs"
            rootfs.mkdir()
            os.chmod(rootfs, 0o755)
            build(rootfs)
            version = _tree_version(rootfs)
            meta = {"name": name, "kind": kind, "version": version, "created": time.time(), **extra}
            (tmp / _META).write_text(json.dumps(meta, indent=2) + "\n")
            final = bases / name
            if final.exists():
                old = bases / f".old-{name}-{secrets.token_hex(4)}"
                final.rename(old)
                remove_tree(old)
            tmp.rename(final)
        except BaseException:
            remove_tree(tmp)
            raise
    return BaseFS(name, bases / name / "rootfs", version)


_DIRS = {
    "bin": 0o755, "sbin": 0o755, "usr": 0o755, "usr/bin": 0o755, "usr/sbin": 0o755, "usr/lib": 0o755,
    "lib": 0o755, "lib64": 0o755, "etc": 0o755, "root": 0o700, "home": 0o755, "tmp": 0o1777,
    "var": 0o755, "var/tmp": 0o1777, "var/log": 0o755, "proc": 0o555, "dev": 0o755, "sys": 0o555,
    "run": 0o755, "mnt": 0o755, "opt": 0o755, "srv": 0o755,
}  # fmt: skip

_ETC = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "etc/hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost\n",
    "etc/os-release": 'NAME="aospec busybox base"\nID=aospec-busybox\n',
    "etc/profile": "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n",
    "etc/resolv.conf": "",  # the mount point of the host's resolv.conf when network is allowed
}


def _host_libs(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    libs = []
    for line in out.splitlines():
        m = re.search(r"=>\s*(/\S+)", line) or re.match(r"\s*(/\S+)\s+\(", line)
        if m:
            libs.append(m.group(1))
    return libs


def _copy_binary(src: str, rootfs: Path, dest: str) -> None:
    target = rootfs / dest.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(os.path.realpath(src), target)
    os.chmod(target, 0o755)


def build_busybox_base(rootfs: Path, *, with_bash: bool = True) -> None:
    """Populate ``rootfs`` with busybox-static, its applet links, a minimal /etc, and (when
    the host has it) bash with its shared libraries."""
    busybox = shutil.which("busybox")
    if busybox is None:
        raise SandboxUnavailableError(
            "busybox is not installed; install busybox-static (apt-get install busybox-static)"
        )
    for d, mode in _DIRS.items():
        (rootfs / d).mkdir(parents=True, exist_ok=True)
        os.chmod(rootfs / d, mode)
    _copy_binary(busybox, rootfs, "/bin/busybox")
    applets = subprocess.run([busybox, "--list-full"], capture_output=True, text=True, check=True).stdout.split()
    for applet in applets:
        link = rootfs / applet
        if applet in ("bin/busybox",) or os.path.lexists(link):
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink("/bin/busybox", link)
    bash = shutil.which("bash")
    if with_bash and bash:
        _copy_binary(bash, rootfs, "/bin/bash")
        for lib in _host_libs(bash):
            _copy_binary(lib, rootfs, lib)
            os.chmod(rootfs / lib.lstrip("/"), 0o644 if ".so" in lib and "ld-linux" not in lib else 0o755)
    elif not (rootfs / "bin/bash").exists():
        os.symlink("/bin/busybox", rootfs / "bin/bash")
    for rel, text in _ETC.items():
        (rootfs / rel).write_text(text)
        os.chmod(rootfs / rel, 0o644)


_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]*$")
_SUITE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _packages(include: object) -> tuple[str, ...]:
    """The sorted, de-duplicated package set of ``include`` (``"a,b"`` or an iterable);
    each name must be a Debian package name."""
    if include is None:
        return ()
    items = include.split(",") if isinstance(include, str) else list(include)  # type: ignore[call-overload]
    out = set()
    for item in items:
        name = str(item).strip()
        if not name:
            continue
        if not _PACKAGE.match(name):
            raise SandboxError(f"invalid Debian package name {name!r} in --include")
        out.add(name)
    return tuple(sorted(out))


def parse_debootstrap_spec(
    spec: str, *, suite: str = "bookworm", include: object = None
) -> tuple[str, tuple[str, ...]]:
    """``debootstrap[:SUITE][+PKG,...]`` -> (suite, sorted packages); ``include`` (from
    ``--include``) adds to the packages the spec names."""
    if not (spec == "debootstrap" or spec.startswith(("debootstrap:", "debootstrap+"))):
        raise SandboxError(f"not a debootstrap base spec: {spec!r}")
    rest = spec[len("debootstrap") :]
    rest, _, pkgs = rest.partition("+")
    suite = rest[1:] if rest.startswith(":") and rest[1:] else suite
    if not _SUITE.match(suite):
        raise SandboxError(f"invalid Debian suite {suite!r}")
    return suite, _packages([*_packages(pkgs), *_packages(include)])


def debootstrap_name(suite: str, packages: tuple[str, ...] = ()) -> str:
    """The cache name of a debootstrap base: ``debootstrap-SUITE`` without extra packages,
    else ``debootstrap-SUITE-with-PKG_PKG...-HASH`` (the readable part sanitised for Docker
    image names; the hash of the exact sorted set keeps different sets apart)."""
    if not packages:
        return f"debootstrap-{suite}"
    import hashlib

    digest = hashlib.sha256(",".join(packages).encode()).hexdigest()[:8]
    readable = "_".join(re.sub(r"[^a-z0-9.-]+", "", p) for p in packages)[:60].strip("._-")
    return f"debootstrap-{suite}-with-{readable}-{digest}"


def build_debootstrap_base(
    rootfs: Path, *, suite: str = "bookworm", mirror: str | None = None, include: tuple[str, ...] = ()
) -> None:
    """``debootstrap --variant=minbase [--include PKG,...] SUITE`` into ``rootfs`` (needs a
    Debian mirror)."""
    if shutil.which("debootstrap") is None:
        raise SandboxUnavailableError("debootstrap is not installed; install it (apt-get install debootstrap)")
    cmd = ["debootstrap", "--variant=minbase"]
    if include:
        cmd.append("--include=" + ",".join(_packages(include)))
    cmd += [suite, str(rootfs)]
    if mirror:
        cmd.append(mirror)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise SandboxError(f"debootstrap failed (is a Debian mirror reachable? pass --mirror URL):\n{tail}")
    for extra in ("proc", "dev", "sys", "tmp"):
        (rootfs / extra).mkdir(exist_ok=True)


def export_image_base(rootfs: Path, image: str) -> None:
    """Export Docker image ``image`` (its merged filesystem) into ``rootfs``."""
    from aospec.runtime.daemon import docker_client

    client = docker_client()
    try:
        container = client.containers.create(image, command=["/bin/true"], network_disabled=True)
    except Exception as exc:
        raise SandboxUnavailableError(f"cannot create a container from image {image!r}: {exc}") from None
    try:
        stream = container.export(chunk_size=1 << 20)
        r, w = os.pipe()
        errors: list[BaseException] = []

        def pump() -> None:
            try:
                with os.fdopen(w, "wb") as wf:
                    for chunk in stream:
                        wf.write(chunk)
            except BaseException as exc:  # BrokenPipe when extraction failed first
                errors.append(exc)

        t = threading.Thread(target=pump)
        t.start()
        try:
            with os.fdopen(r, "rb") as rf, tarfile.open(fileobj=rf, mode="r|") as tar:
                tar.extractall(rootfs, numeric_owner=True, filter="fully_trusted")
        finally:
            t.join()
        if errors and not isinstance(errors[0], BrokenPipeError):
            raise SandboxError(f"exporting image {image!r} failed: {errors[0]}")
    finally:
        container.remove(force=True)
        client.close()
    for extra in ("proc", "dev", "sys", "tmp"):
        (rootfs / extra).mkdir(exist_ok=True)


def _image_name(image: str) -> str:
    return "image-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", image)


def build_base(
    spec: str = "busybox",
    *,
    force: bool = False,
    suite: str = "bookworm",
    mirror: str | None = None,
    include: object = None,
) -> BaseFS:
    """Build (or return the cached) base named by ``spec``: ``busybox``,
    ``debootstrap[:SUITE][+PKG,...]`` or ``image:NAME``. ``include`` (``"a,b"`` or a list)
    adds packages to a debootstrap base."""
    if spec == "busybox":
        if include:
            raise SandboxError("--include applies to debootstrap bases only")
        return _install("busybox", "busybox", build_busybox_base, force=force)
    if spec == "debootstrap" or spec.startswith(("debootstrap:", "debootstrap+")):
        suite, packages = parse_debootstrap_spec(spec, suite=suite, include=include)
        return _install(
            debootstrap_name(suite, packages),
            "debootstrap",
            lambda root: build_debootstrap_base(root, suite=suite, mirror=mirror, include=packages),
            force=force,
            suite=suite,
            mirror=mirror,
            include=list(packages),
        )
    if include:
        raise SandboxError("--include applies to debootstrap bases only")
    if spec.startswith("image:"):
        image = spec.partition(":")[2]
        return _install(
            _image_name(image), "image", lambda root: export_image_base(root, image), force=force, image=image
        )
    raise SandboxError(
        f"unknown base kind {spec!r}; use busybox, debootstrap[:SUITE][+PKG,...], image:NAME or a directory"
    )


def open_base(spec: str | os.PathLike[str] | None = None, *, build: bool = True) -> BaseFS:
    """Resolve a base spec to a BaseFS. ``busybox`` is built on first use when ``build``;
    the other built kinds must have been built (``aospec sandbox build-base``)."""
    spec = "busybox" if spec is None else spec
    named = isinstance(spec, str) and (spec == "busybox" or spec.startswith(("image:", "debootstrap")))
    if not named:
        path = Path(spec).resolve()
        if not path.exists() and "/" not in str(spec):
            raise SandboxUnavailableError(
                f"unknown base {str(spec)!r}; use busybox, debootstrap[:SUITE], image:NAME or a directory path"
            )
        if not path.is_dir():
            raise SandboxUnavailableError(f"base directory {str(path)!r} does not exist or is not a directory")
        if not any((path / s).exists() or (path / s).is_symlink() for s in ("bin/sh", "bin/bash", "usr/bin/bash")):
            raise SandboxUnavailableError(
                f"base directory {str(path)!r} has no /bin/sh or /bin/bash; it cannot run commands"
            )
        return BaseFS(path.name or "/", path, _tree_version(path))
    if spec == "busybox":
        found = _cached("busybox")
        if found is not None:
            return found
        if build:
            return build_base("busybox")
    else:
        if spec.startswith("debootstrap"):
            try:
                name = debootstrap_name(*parse_debootstrap_spec(spec))
            except SandboxError as exc:
                raise SandboxUnavailableError(str(exc)) from None
        else:
            name = _image_name(spec.partition(":")[2])
        found = _cached(name)
        if found is not None:
            return found
    raise SandboxUnavailableError(f"base {spec!r} is not built yet; build it with: aospec sandbox build-base {spec}")
