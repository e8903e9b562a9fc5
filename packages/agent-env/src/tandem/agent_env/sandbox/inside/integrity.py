"""The test framework as it was before any of the agent's code ran, checked after.

Classic test files (``unittest`` ids, ``pytest`` node ids) run in the interpreter that imports
the agent's code, so that code can change how outcomes come about: replace or re-code
``unittest.TestCase.run``, an assertion, this runner's reporting function or a builtin they
call; add an attribute that overrides one (a ``__getattribute__`` on ``TestCase``, a module
global shadowing a builtin); shadow a method on the result or loader object; swap a hidden
test's method; or install a trace function (which can jump over an assertion). `Snapshot`
records, before the agent's code is imported, every name in the ``unittest`` modules, in their
classes, in the runner's own namespace and in ``builtins``, with each function's code and
defaults, and `Snapshot.problem` says what differs. The runner checks after each test's import
and after each test's run; a difference scores the grading 0.

What this cannot see: changes to data (a result's lists, a closure's cell), changes undone
before the next check, import hooks (``sys.meta_path``, which legitimate libraries also use),
and code that finds the runner's own functions in memory and calls them. The package README
("Threat model") says what that leaves open.
"""

import builtins
import sys

# settings such as ``TestCase.maxDiff`` that a test may change (they decide no outcome)
_SETTING = (int, bool, type(None))


def _functions(value):
    """The functions behind a namespace entry (a plain function, a static or class method,
    a property's accessors)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if f is not None]
    return [value] if type(value).__name__ == "function" else []


def _shape(fn):
    return (fn.__code__, fn.__defaults__, fn.__kwdefaults__)


class Snapshot:
    """Names and function code of ``modules`` (and the classes they define), of the
    namespaces in ``extra`` (label -> dict or class) and of ``builtins``."""

    def __init__(self, modules, extra=()):
        self.spaces = []  # (label, live namespace, copy, may grow)
        self.modules = {m.__name__: m for m in modules}
        for module in modules:
            self._add(module.__name__, vars(module), grows=True)
            for name, value in list(vars(module).items()):
                if isinstance(value, type) and value.__module__ == module.__name__:
                    self._add(f"{module.__name__}.{name}", vars(value))
        for label, space in extra:
            self._add(label, vars(space) if isinstance(space, type) else space)
        self._add("builtins", vars(builtins), grows=True)
        self.functions = {
            id(fn): (fn, _shape(fn))
            for _, _, copy, _ in self.spaces
            for value in copy.values()
            for fn in _functions(value)
        }

    def _add(self, label, space, grows=False):
        self.spaces.append((label, space, dict(space), grows))

    def problem(self):
        """What was changed since the snapshot, or ""."""
        if sys.gettrace() is not None or sys.getprofile() is not None:
            return "a trace or profile function is installed"
        for name, module in self.modules.items():
            if sys.modules.get(name) is not module:
                return f"module {name} was replaced"
        for label, space, copy, grows in self.spaces:
            for name, value in copy.items():
                now = space.get(name, copy)
                if now is not value and not (type(now) in _SETTING and type(value) in _SETTING):
                    return f"{label}.{name} was replaced or removed"
            if len(space) != len(copy):
                for name in space.keys() - copy.keys():
                    # a module grows a submodule when one is imported; builtins are looked
                    # up last, so a new name there overrides nothing
                    if label == "builtins" or (grows and type(space[name]) is type(sys)):
                        continue
                    if grows and name == "IsolatedAsyncioTestCase":  # unittest's lazy import
                        continue
                    return f"{label}.{name} was added"
        for fn, shape in self.functions.values():
            if any(now is not then for now, then in zip(_shape(fn), shape, strict=True)):
                return f"{fn.__qualname__} was re-coded"
        return ""


def shadowed(obj, cls):
    """An attribute of ``obj``'s own that hides a method of ``cls``, or ""."""
    if type(obj) is not cls:
        return f"{cls.__name__} object's class was changed"
    for name, value in vars(obj).items():
        if callable(value) and callable(getattr(cls, name, None)):
            return f"{cls.__name__}.{name} was shadowed on the object"
    return ""
