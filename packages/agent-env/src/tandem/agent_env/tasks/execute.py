"""Deterministic, bounded evaluation of generated code while building tasks.

Expected values of hidden tests come from running the reference code; the mutant is run on
the same inputs to keep only inputs that expose the bug. Both run in-process under a line
budget (``sys.settrace``), which is deterministic, unlike a wall-clock timeout, so the same
seed always yields the same tasks; a mutant that exceeds the budget is rejected.
"""

from __future__ import annotations

import copy
import sys
import types
from typing import Any

_LINE_BUDGET = 50_000


class BudgetExceeded(Exception):
    """The code ran more lines than the budget allows (probably an infinite loop)."""


def load(source: str, name: str) -> types.ModuleType:
    """Execute ``source`` as a fresh module (not registered in sys.modules)."""
    mod = types.ModuleType(name)
    mod.__file__ = f"<tandem-task:{name}>"
    code = compile(source, mod.__file__, "exec")
    exec(code, mod.__dict__)
    return mod


def call(
    mod: types.ModuleType, func: str, args: tuple, budget: int = _LINE_BUDGET
) -> tuple[str, Any]:
    """Call ``mod.func(*args)`` on a deep copy of args: ("ok", value), ("raise", text) or
    ("budget", None)."""
    filename = mod.__file__
    left = [budget]

    def local(frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            left[0] -= 1
            if left[0] < 0:
                raise BudgetExceeded
        return local

    def global_(frame: types.FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == filename else None

    old = sys.gettrace()
    sys.settrace(global_)
    try:
        return "ok", getattr(mod, func)(*copy.deepcopy(args))
    except BudgetExceeded:
        return "budget", None
    except RecursionError:
        return "budget", None
    except Exception as e:
        return "raise", f"{type(e).__name__}: {e}"
    finally:
        sys.settrace(old)


def same(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    return a[0] == b[0] and type(a[1]) is type(b[1]) and repr(a[1]) == repr(b[1])
