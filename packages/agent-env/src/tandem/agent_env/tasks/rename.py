"""Seeded renaming of a template function's parameters and local variables.

A small policy that sees the same reference function in every task can fix a bug without
reading the file: it recalls the fix text of one of the function's bugs. With the locals
renamed per task, no fix text recurs, and an edit's old string has to be copied from the
file the policy read. The function's name, its behaviour and its calls stay as they were
(tests call it positionally); the docstring's words follow the renaming.
"""

from __future__ import annotations

import ast
import io
import random
import re
import tokenize
from collections.abc import Collection

from tandem.agent_env.tasks.mutate import find_function, local_names
from tandem.agent_env.tasks.templates import Template

NAME_POOL = (
    "a", "b", "c", "k", "m", "n", "p", "q", "s", "t", "x", "y",
    "xs", "ys", "seq", "items", "values", "data", "text", "word", "chars", "parts",
    "acc", "total", "out", "res", "result", "count", "size", "width", "step", "lo", "hi",
    "left", "right", "num", "val", "cur", "prev", "idx", "pos", "key", "item", "elem",
    "buf", "chunk", "rest", "first", "last", "head", "tail", "base", "start", "stop",
)  # fmt: skip
"""Identifiers the renaming draws from: everyday names, none a builtin or keyword."""


def rename_mapping(tree: ast.Module, function: str, rng: random.Random) -> dict[str, str]:
    """A random one-to-one renaming of ``function``'s parameters and locals (in ``tree``) to
    names of `NAME_POOL` that the source does not use otherwise (a name may keep itself)."""
    local = local_names(find_function(tree, function))
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {function}
    free = [n for n in NAME_POOL if n not in used or n in local]
    if len(free) < len(local):
        raise ValueError(f"{function}: {len(local)} locals, only {len(free)} names to draw")
    return dict(zip(local, rng.sample(free, len(local)), strict=True))


def rename_source(source: str, mapping: dict[str, str], in_text: Collection[str] = ()) -> str:
    """``source`` with every name token in ``mapping`` renamed (attributes and keyword
    arguments of calls keep theirs), and the words ``in_text`` (the parameters, which a
    docstring names) renamed in its one-line strings too."""
    said = sorted(set(in_text) & set(mapping))
    words = re.compile(r"\b(" + "|".join(map(re.escape, said)) + r")\b") if said else None
    edits: list[tuple[int, int, int, str]] = []
    previous = ""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, tok in enumerate(tokens):
        (row, col), (end_row, end_col) = tok.start, tok.end
        if tok.type == tokenize.NAME and tok.string in mapping and previous != ".":
            following = tokens[i + 1].string if i + 1 < len(tokens) else ""
            in_call_keyword = following == "=" and _inside_call(tokens, i)
            if not in_call_keyword:
                edits.append((row, col, end_col, mapping[tok.string]))
        elif tok.type == tokenize.STRING and words is not None and row == end_row:
            text = words.sub(lambda m: mapping[m.group(1)], tok.string)
            if text != tok.string:
                edits.append((row, col, end_col, text))
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            previous = tok.string
    lines = source.splitlines(keepends=True)
    for row, col, end_col, text in sorted(edits, reverse=True):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + text + line[end_col:]
    return "".join(lines)


def _inside_call(tokens: list[tokenize.TokenInfo], i: int) -> bool:
    """Whether token ``i`` sits directly inside the parentheses of a call (``f(x=1)``), not in
    a ``def``'s parameter list or a plain expression."""
    depth = 0
    for j in range(i - 1, -1, -1):
        s = tokens[j].string
        if s in (")", "]", "}"):
            depth += 1
        elif s in ("(", "[", "{"):
            if depth == 0:
                before = tokens[j - 1] if j > 0 else None
                is_def = j > 1 and tokens[j - 2].string == "def"
                return (
                    s == "(" and before is not None and before.type == tokenize.NAME and not is_def
                )
            depth -= 1
    return False


def renamed(template: Template, rng: random.Random) -> Template:
    """``template`` with its locals renamed by a mapping drawn from ``rng``."""
    tree = ast.parse(template.source)
    mapping = rename_mapping(tree, template.name, rng)
    args = find_function(tree, template.name).args
    params = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
    return Template(template.name, rename_source(template.source, mapping, params), template.inputs)
