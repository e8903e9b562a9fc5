"""The canonical text of a value, with its exact types: how a hidden-test case's result
travels from the test process to the judge, and how its expected value is kept on the host.

Only exact built-in types are encoded (``type(x) is int``, not an ``int`` subclass or an
object whose ``__eq__`` says yes); anything else raises ``TypeError``, so such a result can
never equal an expected value. Sets and dicts are ordered by their items' text, so equal
values have equal text whatever their insertion order. Floats keep every bit (``float.hex``).

Stdlib only and import-free: the host imports it too, for the expected values.
"""

_MAX_DEPTH = 64


def canon(value, limit=1 << 16):
    """``value`` as canonical text of at most ``limit`` characters (``ValueError`` past it)."""
    out = []
    _put(value, out, 0, [limit])
    return "".join(out)


def _put(x, out, depth, left):
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    t = type(x)
    if x is None:
        text = "N"
    elif t is bool:
        text = "T" if x else "F"
    elif t is int:
        text = "i" + str(x)
    elif t is float:
        text = "f" + x.hex()
    elif t is complex:
        text = "c" + x.real.hex() + "," + x.imag.hex()
    elif t is str or t is bytes:
        text = ("s" if t is str else "b") + repr(x)
    elif t is list or t is tuple:
        out.append("[" if t is list else "(")
        for item in x:
            _put(item, out, depth + 1, left)
            out.append(",")
        text = "]" if t is list else ")"
    elif t is dict or t is set or t is frozenset:
        items = []
        for item in x.items() if t is dict else x:
            sub = []
            if t is dict:
                _put(item[0], sub, depth + 1, left)
                sub.append(":")
                _put(item[1], sub, depth + 1, left)
            else:
                _put(item, sub, depth + 1, left)
            items.append("".join(sub))
        items.sort()
        text = {dict: "{", set: "<", frozenset: "<<"}[t] + ",".join(items) + ">}"[t is dict]
    else:
        raise TypeError(f"a result of type {t.__name__!r} is not a plain value")
    left[0] -= len(text)
    if left[0] < 0:
        raise ValueError("value too large")
    out.append(text)
