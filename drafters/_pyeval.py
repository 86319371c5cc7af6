"""What a small ``python -c`` program prints, without running it.

:func:`python_output` evaluates programs made only of imports, ``pass``, assignments of
literals to names and ``print`` calls whose arguments are literals, f-strings over those,
names bound to literals, arithmetic on them, and *remembered values*: expressions whose
printed value an earlier step showed (``mteb.__version__`` after
``python -c "import mteb; print(mteb.__version__)"`` printed ``1.36.8``), usable where only
their text matters (a ``print`` argument, an f-string field without a format spec) and only
once the program imported what they start from. Anything else gives None: the drafter
abstains.

:func:`remembered_values` reads such values off a program and the output it printed, when
the output's lines line up with the program's ``print`` calls one for one.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping

__all__ = ["python_output", "remembered_values"]

_MAX_OUTPUT = 20_000
_MAX_NUMBER = 10**18


class _Cannot(Exception):
    """The program's output cannot be known without running it."""


class _Remembered:
    __slots__ = ("expr", "text")

    def __init__(self, expr: str, text: str) -> None:
        self.expr, self.text = expr, text


def _parse(code: str) -> list[ast.stmt] | None:
    try:
        return ast.parse(code, mode="exec").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _roots(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


class _Evaluator:
    def __init__(self, values: Mapping[str, str]) -> None:
        self.values = values
        self.env: dict[str, object] = {}
        self.modules: set[str] = set()
        self.imports: set[str] = set()
        self.uses: set[str] = set()

    def statement(self, node: ast.stmt, out: list[str]) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                self.imports.add(alias.name.split(".")[0])
                self.modules.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level or not node.module:
                raise _Cannot
            self.imports.add(node.module.split(".")[0])
            for alias in node.names:
                if alias.name == "*":
                    raise _Cannot
                self.modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Pass):
            pass
        elif isinstance(node, ast.Assign):
            if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
                raise _Cannot
            value = self.expr(node.value)
            if isinstance(value, _Remembered):
                raise _Cannot  # its type is not known
            self.env[node.targets[0].id] = value
            self.modules.discard(node.targets[0].id)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            self.print(node.value, out)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            pass  # a docstring
        else:
            raise _Cannot

    def print(self, call: ast.Call, out: list[str]) -> None:
        if not isinstance(call.func, ast.Name) or call.func.id != "print" or "print" in self.env:
            raise _Cannot
        sep, end = " ", "\n"
        for kw in call.keywords:
            value = self.expr(kw.value) if kw.arg in ("sep", "end") else None
            if kw.arg == "sep" and (isinstance(value, str) or value is None):
                sep = " " if value is None else value
            elif kw.arg == "end" and (isinstance(value, str) or value is None):
                end = "\n" if value is None else value
            elif kw.arg == "flush":
                continue
            else:
                raise _Cannot
        if any(isinstance(a, ast.Starred) for a in call.args):
            raise _Cannot
        out.append(sep.join(self.text(a) for a in call.args) + end)
        if sum(len(x) for x in out) > _MAX_OUTPUT:
            raise _Cannot

    def text(self, node: ast.expr) -> str:
        value = self.expr(node)
        return value.text if isinstance(value, _Remembered) else str(value)

    def remembered(self, node: ast.expr) -> _Remembered | None:
        try:
            source = ast.unparse(node)
        except (ValueError, RecursionError):
            return None
        text = self.values.get(source)
        if text is None:
            return None
        roots = _roots(node)
        builtins = {"len", "str", "repr", "type", "sorted", "list"}
        if not roots or not roots <= (self.modules | builtins) or roots & set(self.env):
            return None
        self.uses.add(source)
        return _Remembered(source, text)

    def expr(self, node: ast.expr) -> object:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (str, int, float, bool)) or node.value is None:
                return node.value
            raise _Cannot
        if isinstance(node, ast.Name) and node.id in self.env:
            return self.env[node.id]
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                if isinstance(v, ast.Constant):
                    parts.append(str(v.value))
                elif isinstance(v, ast.FormattedValue):
                    value = self.expr(v.value)
                    if isinstance(value, _Remembered):
                        if v.format_spec is not None or v.conversion not in (-1, ord("s")):
                            raise _Cannot
                        parts.append(value.text)
                        continue
                    spec = "" if v.format_spec is None else self.text(v.format_spec)
                    if v.conversion == ord("r"):
                        value = repr(value)
                    elif v.conversion == ord("a"):
                        value = ascii(value)
                    try:
                        parts.append(format(value, spec))
                    except (ValueError, TypeError):
                        raise _Cannot from None
                else:
                    raise _Cannot
            return "".join(parts)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            left, right = self.expr(node.left), self.expr(node.right)
            if isinstance(left, _Remembered) or isinstance(right, _Remembered):
                raise _Cannot
            if isinstance(left, str) and isinstance(right, str) and isinstance(node.op, ast.Add):
                return left + right
            if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (left, right)):
                result = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}[
                    type(node.op)
                ](left, right)  # type: ignore[operator]
                if abs(result) > _MAX_NUMBER:
                    raise _Cannot
                return result
            raise _Cannot
        found = self.remembered(node)
        if found is not None:
            return found
        raise _Cannot


def python_output(code: str, values: Mapping[str, str]) -> tuple[str, set[str], set[str]] | None:
    """(what ``python -c code`` prints, the remembered expressions it used, the top-level
    modules it imports), or None when the program is outside what is evaluated (module doc).
    ``values`` maps an expression's source (``ast.unparse``) to its printed text."""
    body = _parse(code)
    if body is None:
        return None
    ev = _Evaluator(values)
    out: list[str] = []
    try:
        for node in body:
            ev.statement(node, out)
    except (_Cannot, RecursionError, OverflowError, MemoryError):
        return None
    return "".join(out), ev.uses, ev.imports


def remembered_values(code: str, output: str) -> list[tuple[str, str]]:
    """(expression source, printed text) pairs that ``output`` shows for the expressions
    ``code`` prints: every statement an import, an assignment or a single-argument ``print``
    (a bare expression, or an f-string with one field between literal text), the output's
    lines one per ``print``. Expressions over names the program assigned are left out."""
    body = _parse(code)
    if body is None or not output.endswith("\n"):
        return []
    lines = output[:-1].split("\n")
    prints: list[ast.expr] = []
    assigned: set[str] = set()
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass)):
            continue
        if isinstance(node, ast.Assign):
            assigned |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            continue
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "print"
            and len(node.value.args) == 1
            and not node.value.keywords
        ):
            prints.append(node.value.args[0])
            continue
        return []
    if len(prints) != len(lines):
        return []
    out = []
    for arg, line in zip(prints, lines, strict=True):
        expr, prefix, suffix = arg, "", ""
        if isinstance(arg, ast.JoinedStr):
            fields = [v for v in arg.values if isinstance(v, ast.FormattedValue)]
            if len(fields) != 1 or fields[0].format_spec is not None or fields[0].conversion not in (-1, ord("s")):
                continue
            k = arg.values.index(fields[0])
            if not all(isinstance(v, ast.Constant) for v in arg.values if v is not fields[0]):
                continue
            prefix = "".join(str(v.value) for v in arg.values[:k])  # type: ignore[attr-defined]
            suffix = "".join(str(v.value) for v in arg.values[k + 1 :])  # type: ignore[attr-defined]
            expr = fields[0].value
        if isinstance(expr, ast.Constant) or _roots(expr) & assigned or not _roots(expr):
            continue
        if not (line.startswith(prefix) and line.endswith(suffix) and len(line) >= len(prefix) + len(suffix)):
            continue
        try:
            source = ast.unparse(expr)
        except (ValueError, RecursionError):
            continue
        out.append((source, line[len(prefix) : len(line) - len(suffix)]))
    return out
