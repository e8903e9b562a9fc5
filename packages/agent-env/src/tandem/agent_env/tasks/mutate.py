"""Bug injection by AST mutation of one function, applied as a minimal text edit.

A mutation replaces the exact source span of one AST node (or deletes the lines of one
branch), so the rest of the file keeps its formatting and comments, and the reference fix is a
small exact-string edit that an oracle can send to the ``edit`` tool.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass

BUG_KINDS = (
    "wrong_operator",
    "off_by_one",
    "wrong_constant",
    "swapped_arguments",
    "missing_case",
    "wrong_variable",
    "wrong_return",
)

_BINOP_SWAP: dict[type, type] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Add,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mod,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
}
_CMP_SWAP: dict[type, type] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}


@dataclass(frozen=True)
class Mutation:
    """Replace source lines [start, end) (0-based, whole lines) with ``new_lines``."""

    kind: str
    start: int
    end: int
    new_lines: tuple[str, ...]
    description: str


def _span_replace(lines: list[str], node: ast.AST, text: str) -> tuple[int, int, tuple[str, ...]]:
    """Whole-line replacement for a node span (offsets are UTF-8 byte columns)."""
    first, last = node.lineno - 1, node.end_lineno - 1  # type: ignore[attr-defined]
    head = lines[first].encode()[: node.col_offset].decode()  # type: ignore[attr-defined]
    tail = lines[last].encode()[node.end_col_offset :].decode()  # type: ignore[attr-defined]
    return first, last + 1, tuple((head + text + tail).split("\n"))


def local_names(fn: ast.FunctionDef) -> list[str]:
    """``fn``'s parameters and the names it assigns, sorted."""
    names = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return sorted(names)


def find_function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise KeyError(name)


def _copy_with(node: ast.AST, **changes: object) -> ast.AST:
    import copy

    new = copy.deepcopy(node)
    for k, v in changes.items():
        setattr(new, k, v)
    return new


def candidates(source: str, func: str, kind: str) -> list[Mutation]:
    """Every mutation of ``kind`` inside function ``func`` of ``source``."""
    tree = ast.parse(source)
    fn = find_function(tree, func)
    lines = source.split("\n")
    out: list[Mutation] = []
    body_nodes = [n for stmt in fn.body for n in ast.walk(stmt)]
    parents: dict[ast.AST, ast.AST] = {}
    for stmt in fn.body:
        for p in ast.walk(stmt):
            for c in ast.iter_child_nodes(p):
                parents[c] = p

    def add(node: ast.AST, new: ast.AST, desc: str) -> None:
        s, e, nl = _span_replace(lines, node, ast.unparse(new))
        out.append(Mutation(kind, s, e, nl, desc))

    locals_ = local_names(fn)
    if kind == "wrong_operator":
        for n in body_nodes:
            if isinstance(n, ast.BinOp) and type(n.op) in _BINOP_SWAP:
                add(n, _copy_with(n, op=_BINOP_SWAP[type(n.op)]()), "binary operator")
            elif isinstance(n, ast.Compare) and len(n.ops) == 1 and type(n.ops[0]) in _CMP_SWAP:
                add(n, _copy_with(n, ops=[_CMP_SWAP[type(n.ops[0])]()]), "comparison")
            elif isinstance(n, ast.BoolOp):
                add(
                    n,
                    _copy_with(n, op=ast.Or() if isinstance(n.op, ast.And) else ast.And()),
                    "boolean",
                )
            elif isinstance(n, ast.AugAssign) and type(n.op) in _BINOP_SWAP:
                add(n, _copy_with(n, op=_BINOP_SWAP[type(n.op)]()), "augmented assignment")
    elif kind == "off_by_one":
        for n in body_nodes:
            parent = parents.get(n)
            if (
                isinstance(n, ast.Constant)
                and type(n.value) is int
                and isinstance(parent, (ast.Compare, ast.Subscript, ast.Slice, ast.BinOp, ast.Call))
            ):
                for d in (1, -1):
                    if n.value + d >= 0:
                        add(n, ast.Constant(n.value + d), f"integer {n.value} -> {n.value + d}")
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id == "range"
                and n.args
            ):
                last = n.args[-1]
                if not isinstance(last, ast.Constant):
                    for op in (ast.Add(), ast.Sub()):
                        new_last = ast.BinOp(last, op, ast.Constant(1))
                        add(n, _copy_with(n, args=[*n.args[:-1], new_last]), "range bound")
    elif kind == "wrong_constant":
        for n in body_nodes:
            if (
                isinstance(n, ast.Constant)
                and n.value is not None
                and not isinstance(n.value, bytes)
            ):
                v = n.value
                if isinstance(v, bool):
                    alts: list[object] = [not v]
                elif isinstance(v, int):
                    alts = [v * 2 + 2, 0 if v else 1, v + 10]
                elif isinstance(v, float):
                    alts = [v * 2 + 0.5, v / 2 if v else 1.0]
                elif isinstance(v, str) and isinstance(
                    parents.get(n), (ast.Call, ast.Compare, ast.Return, ast.BinOp)
                ):
                    alts = [
                        v[:-1] if len(v) > 1 else v + "_",
                        v.upper() if v != v.upper() else v + " ",
                    ]
                else:
                    alts = []
                for a in alts:
                    if a != v:
                        add(n, ast.Constant(a), f"constant {v!r} -> {a!r}")
    elif kind == "swapped_arguments":
        for n in body_nodes:
            if (
                isinstance(n, ast.Call)
                and len(n.args) >= 2
                and not any(isinstance(a, ast.Starred) for a in n.args)
            ):
                a, b = n.args[0], n.args[1]
                if ast.unparse(a) != ast.unparse(b):
                    add(n, _copy_with(n, args=[b, a, *n.args[2:]]), "arguments swapped")
            if (
                isinstance(n, ast.BinOp)
                and isinstance(n.op, (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow))
                and ast.unparse(n.left) != ast.unparse(n.right)
            ):
                add(n, _copy_with(n, left=n.right, right=n.left), "operands swapped")
    elif kind == "missing_case":
        containers: dict[int, list[ast.stmt]] = {}
        for p in [fn, *body_nodes]:
            for field in ("body", "orelse", "finalbody"):
                block = getattr(p, field, None)
                if isinstance(block, list):
                    for child in block:
                        containers[id(child)] = block
        for n in body_nodes:
            if not isinstance(n, ast.If):
                continue
            parent = parents.get(n)
            is_elif = (
                isinstance(parent, ast.If)
                and parent.orelse == [n]
                and lines[n.lineno - 1].lstrip().startswith("elif")
            )
            if is_elif:
                end = n.body[-1].end_lineno or n.lineno
                out.append(Mutation(kind, n.lineno - 1, end, (), "elif branch removed"))
            elif not n.orelse and len(containers.get(id(n), [])) >= 2:
                end = n.end_lineno or n.lineno
                out.append(Mutation(kind, n.lineno - 1, end, (), "if branch removed"))
    elif kind == "wrong_variable":
        for n in body_nodes:
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in locals_:
                for other in locals_:
                    if other != n.id:
                        add(n, ast.Name(other, ast.Load()), f"variable {n.id} -> {other}")
    elif kind == "wrong_return":
        for n in body_nodes:
            if isinstance(n, ast.Return) and n.value is not None:
                v = n.value
                if isinstance(v, ast.Constant) and isinstance(v.value, bool):
                    add(v, ast.Constant(not v.value), "returned constant")
                    continue
                used = sorted({x.id for x in ast.walk(v) if isinstance(x, ast.Name)} & set(locals_))
                shown = ast.unparse(v)
                for name in [*used, *locals_]:
                    if name != shown:
                        add(v, ast.Name(name, ast.Load()), f"returns {name} instead of {shown}")
    else:
        raise ValueError(f"unknown bug kind {kind!r}; choose from {BUG_KINDS}")
    unique: dict[tuple[int, int, tuple[str, ...]], Mutation] = {}
    for m in out:
        if tuple(lines[m.start : m.end]) != m.new_lines:
            unique.setdefault((m.start, m.end, m.new_lines), m)
    return list(unique.values())


def apply(source: str, m: Mutation) -> str:
    lines = source.split("\n")
    new = "\n".join([*lines[: m.start], *m.new_lines, *lines[m.end :]])
    ast.parse(new)  # a mutation must keep the module valid Python
    return new


def fix_edit(original: str, mutated: str) -> tuple[str, str]:
    """The smallest (old, new) exact replacement turning ``mutated`` back into ``original``,
    with enough surrounding lines that ``old`` occurs exactly once in ``mutated``."""
    a, b = original.split("\n"), mutated.split("\n")
    pre = 0
    while pre < min(len(a), len(b)) and a[pre] == b[pre]:
        pre += 1
    suf = 0
    while suf < min(len(a), len(b)) - pre and a[-1 - suf] == b[-1 - suf]:
        suf += 1
    lo_a, hi_a, lo_b, hi_b = pre, len(a) - suf, pre, len(b) - suf
    while True:
        old = "\n".join(b[lo_b:hi_b])
        new = "\n".join(a[lo_a:hi_a])
        if old.strip() and mutated.count(old) == 1:
            return old, new
        if lo_b == 0 and hi_b == len(b):
            return old, new
        if lo_b > 0:
            lo_a, lo_b = lo_a - 1, lo_b - 1
        if hi_b < len(b):
            hi_a, hi_b = hi_a + 1, hi_b + 1


def pick(rng: random.Random, items: list[Mutation]) -> Mutation:
    return items[rng.randrange(len(items))]
