"""Bugs injected by small edits of a function's source, the way published task generators make them.

A ``Mutation`` is an edit of the original text (a span replaced, so the rest of the file keeps its formatting
and the patch is minimal) inside one function. Operators (``KINDS``):

===============  ====================================================  ==========================
kind             what changes                                          example
===============  ====================================================  ==========================
compare          a comparison operator flipped                         ``<`` -> ``<=``, ``==`` -> ``!=``
off_by_one       an integer constant one off (indices, bounds, steps)  ``x[1:]`` -> ``x[2:]``
drop_statement   a statement (or a whole block) removed                ``total += x`` gone
swap_args        the first two positional arguments of a call swapped  ``f(a, b)`` -> ``f(b, a)``
wrong_default    a parameter's default value changed                   ``strict=True`` -> ``False``
bool_op          ``and`` <-> ``or``                                    ``a and b`` -> ``a or b``
negate           a ``not`` dropped                                     ``if not x`` -> ``if x``
arith            ``+`` <-> ``-``                                       ``n + 1`` -> ``n - 1``
===============  ====================================================  ==========================

``functions(source)`` lists the functions of a module (with their line span); ``mutations(source, function)``
every candidate edit inside one function (nested functions excluded: they are functions of their own).
``apply`` writes one or several non-overlapping edits of the same file.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass

KINDS = ("compare", "off_by_one", "drop_statement", "swap_args", "wrong_default", "bool_op", "negate", "arith")
_COMPARE = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
            ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in"),
            ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is")}
_ARITH = {ast.Add: ("+", "-"), ast.Sub: ("-", "+")}
_BOOL = {ast.And: ("and", "or"), ast.Or: ("or", "and")}
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Function:
    """A function or method of a module: its ``name``, dotted ``qualname``, first line (the first decorator's,
    as the code object counts it: ``first``), ``def`` line and last line."""

    name: str
    qualname: str
    first: int
    lineno: int
    end: int


@dataclass(frozen=True)
class Mutation:
    """Replace ``source[start:end]`` by ``text``; ``kind`` is one of ``KINDS``; ``lines`` the lines it touches."""

    file: str
    function: str  # qualname
    kind: str
    start: int
    end: int
    text: str
    lines: tuple[int, int]

    @property
    def multiline(self) -> bool:
        return self.lines[1] > self.lines[0]


def functions(source: str) -> list[Function]:
    """Every function and method of ``source`` (nested ones too), in order; [] when it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    out: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{prefix}{child.name}"
                first = min([d.lineno for d in child.decorator_list] + [child.lineno])
                out.append(Function(child.name, qual, first, child.lineno, child.end_lineno or child.lineno))
                visit(child, f"{qual}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


class _Source:
    """Offsets in the text from ast positions (whose columns count UTF-8 bytes)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8", "replace"))

    def span(self, node: ast.expr | ast.stmt) -> tuple[int, int]:
        end_line = node.end_lineno if node.end_lineno is not None else node.lineno  # set by ast.parse
        end_col = node.end_col_offset if node.end_col_offset is not None else node.col_offset
        return self.offset(node.lineno, node.col_offset), self.offset(end_line, end_col)

    def segment(self, node: ast.expr | ast.stmt) -> str:
        a, b = self.span(node)
        return self.text[a:b]


def _find_function(tree: ast.AST, fn: Function) -> FunctionNode | None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == fn.name \
                and node.lineno == fn.lineno:
            return node
    return None


def _own_nodes(fn_node: FunctionNode) -> list[ast.expr | ast.stmt]:
    """The expressions and statements of a function's body, not descending into nested functions, classes or
    lambdas."""
    out: list[ast.expr | ast.stmt] = []
    todo: list[ast.AST] = list(fn_node.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.expr, ast.stmt)):
            out.append(node)
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                todo.append(child)
    return out


def parse(source: str) -> ast.AST | None:
    """The module's tree with parent links (what ``mutations`` reads), or None when it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    annotate_parents(tree)
    return tree


def mutations(source: str, file: str, fn: Function, tree: ast.AST | None = None) -> list[Mutation]:
    """Every candidate edit inside ``fn`` (see ``KINDS``), in source order. ``tree``: ``parse(source)``, when
    the caller has it (a module's functions share one)."""
    tree = tree if tree is not None else parse(source)
    if tree is None:
        return []
    node = _find_function(tree, fn)
    if node is None:
        return []
    src = _Source(source)
    found: list[Mutation] = []

    def add(kind: str, start: int, end: int, text: str, first: int, last: int) -> None:
        if source[start:end] != text:
            found.append(Mutation(file, fn.qualname, kind, start, end, text, (first, last)))

    for n in _own_nodes(node):
        for kind, a, b, text in _edits(src, n):
            add(kind, a, b, text, n.lineno, n.end_lineno or n.lineno)
    for kind, a, b, text, line in _default_edits(src, node):
        add(kind, a, b, text, line, line)
    for stmt_list in _bodies(node):
        for stmt in stmt_list:
            drop = _drop(src, stmt, stmt_list)
            if drop is not None:
                add("drop_statement", drop[0], drop[1], "", stmt.lineno, stmt.end_lineno or stmt.lineno)
    return sorted(set(found), key=lambda m: (m.start, m.kind, m.end))


def _edits(src: _Source, n: ast.expr | ast.stmt) -> list[tuple[str, int, int, str]]:
    out = []
    if isinstance(n, ast.Compare) and type(n.ops[0]) in _COMPARE:
        old, new = _COMPARE[type(n.ops[0])]
        op = _operator_between(src, n.left, n.comparators[0], old)
        if op is not None:
            out.append(("compare", op[0], op[1], new))
    elif isinstance(n, ast.BinOp) and type(n.op) in _ARITH:
        old, new = _ARITH[type(n.op)]
        op = _operator_between(src, n.left, n.right, old)
        if op is not None:
            out.append(("arith", op[0], op[1], new))
    elif isinstance(n, ast.BoolOp) and type(n.op) in _BOOL and len(n.values) >= 2:
        old, new = _BOOL[type(n.op)]
        op = _operator_between(src, n.values[0], n.values[1], old)
        if op is not None:
            out.append(("bool_op", op[0], op[1], new))
    elif isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
        a, b = src.span(n)
        out.append(("negate", a, b, src.segment(n.operand)))
    elif isinstance(n, ast.Call) and len(n.args) >= 2 and not any(isinstance(a, ast.Starred) for a in n.args[:2]):
        first, second = src.segment(n.args[0]), src.segment(n.args[1])
        if first != second and "\n" not in first + second:
            a0, b0 = src.span(n.args[0])
            a1, b1 = src.span(n.args[1])
            out.append(("swap_args", a0, b1, second + src.text[b0:a1] + first))
    elif isinstance(n, ast.Constant) and type(n.value) is int and n.value < 1000 and _in_arith_or_index(n):
        a, b = src.span(n)
        out.append(("off_by_one", a, b, str(n.value + 1 if n.value in (0, 1) else n.value - 1)))
    return out


def _in_arith_or_index(n: ast.AST) -> bool:
    parent = getattr(n, "_albatross_parent", None)  # set on ast's nodes by annotate_parents (the root has none)
    return parent is None or isinstance(parent, (ast.BinOp, ast.Slice, ast.Subscript, ast.Compare, ast.Call,
                                                 ast.AugAssign, ast.UnaryOp))


def _operator_between(src: _Source, left: ast.expr, right: ast.expr, op: str) -> tuple[int, int] | None:
    """The span of the operator ``op`` between two operands (found by tokens, so strings and comments there
    cannot be mistaken for it)."""
    a, b = src.span(left)[1], src.span(right)[0]
    between = src.text[a:b]
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(between).readline)
                  if t.type in (tokenize.OP, tokenize.NAME)]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        tokens = []
    words = op.split()
    for i in range(len(tokens) - len(words) + 1):
        if [t.string for t in tokens[i:i + len(words)]] == words:
            start = _col(between, tokens[i].start)
            end = _col(between, tokens[i + len(words) - 1].end)
            return a + start, a + end
    match = re.search(rf"(?<![\w<>=!]){re.escape(op)}(?![\w<>=])", between)
    return (a + match.start(), a + match.end()) if match and not re.search(r"[#'\"]", between) else None


def _col(text: str, pos: tuple[int, int]) -> int:
    lines = text.splitlines(keepends=True) or [""]
    return sum(len(line) for line in lines[: pos[0] - 1]) + pos[1]


def _default_edits(src: _Source, fn: FunctionNode) -> list[tuple[str, int, int, str, int]]:
    args = fn.args
    defaults = [*args.defaults, *[d for d in args.kw_defaults if d is not None]]
    out = []
    for d in defaults:
        if not isinstance(d, ast.Constant):
            continue
        a, b = src.span(d)
        if isinstance(d.value, bool):
            out.append(("wrong_default", a, b, str(not d.value), d.lineno))
        elif type(d.value) is int:
            out.append(("wrong_default", a, b, str(d.value + 1), d.lineno))
        elif d.value is None:
            continue
        elif isinstance(d.value, str) and d.value:
            out.append(("wrong_default", a, b, "''", d.lineno))
    return out


def _bodies(fn: FunctionNode) -> list[list[ast.stmt]]:
    """Statement lists of the function (its body, and the bodies of its if/for/while/with/try blocks)."""
    out = []
    todo: list[ast.AST] = [fn]
    while todo:
        node = todo.pop(0)
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)  # ast's node classes: only some have each block
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                out.append(block)
                todo += [s for s in block if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                 ast.ClassDef))]
        for handler in getattr(node, "handlers", []) or []:
            out.append(handler.body)
            todo += handler.body
    return out


def _drop(src: _Source, stmt: ast.stmt, block: list[ast.stmt]) -> tuple[int, int] | None:
    """The whole lines of ``stmt`` when it can go: not alone in its block, not a docstring, ``pass``,
    ``global``/``nonlocal``, a definition, or sharing a line with another statement."""
    if len(block) < 2 or isinstance(stmt, (ast.Pass, ast.Global, ast.Nonlocal, ast.FunctionDef,
                                            ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
        return None
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return None
    first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
    a, b = src.span(stmt)
    line_start, line_end = src.starts[first - 1], src.starts[last]
    before, after = src.text[line_start:a], src.text[b:line_end]
    if before.strip() or (after.strip() and not after.strip().startswith("#")):
        return None
    return line_start, line_end


def annotate_parents(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child._albatross_parent = node  # type: ignore[attr-defined]


def apply(source: str, edits: list[Mutation]) -> str:
    """``source`` with every edit made (they must not overlap); raises ``ValueError`` if they do."""
    out, pos = [], 0
    for m in sorted(edits, key=lambda m: m.start):
        if m.start < pos:
            raise ValueError("overlapping edits")
        out += [source[pos:m.start], m.text]
        pos = m.end
    out.append(source[pos:])
    return "".join(out)


def valid(source: str) -> bool:
    """Whether ``source`` still parses (a mutant that does not is no bug worth a task)."""
    try:
        ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True
