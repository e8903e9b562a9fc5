"""A minimal JSON codec for the supervisor (stdlib's json imports re, enum and collections,
which costs more than the interpreter's own start-up; the supervisor starts once per episode).

Handles what the host sends and receives: null, booleans, numbers, strings (with \\u escapes
and surrogate pairs), lists and objects with string keys.
"""

_ESC = {i: f"\\u{i:04x}" for i in range(32)}
_ESC.update({ord('"'): '\\"', ord("\\"): "\\\\", 10: "\\n", 13: "\\r", 9: "\\t"})
_SURROGATES = {}  # lone surrogates (from undecodable bytes), escaped; built on first need


def _escape(text):
    out = text.translate(_ESC)
    try:
        out.encode("utf-8")
    except UnicodeEncodeError:  # rare: building this table costs more than a small start-up
        if not _SURROGATES:
            _SURROGATES.update({i: f"\\u{i:04x}" for i in range(0xD800, 0xE000)})
        out = out.translate(_SURROGATES)
    return out


_UNESC = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_WS = " \t\r\n"
_NUM = set("+-0123456789.eE")


def dumps(obj):
    """JSON text for None/bool/int/float/str/list/tuple/dict (str keys)."""
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, (int, float)):
        return repr(obj)
    if isinstance(obj, str):
        return '"' + _escape(obj) + '"'
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in obj) + "]"
    if isinstance(obj, dict):
        return "{" + ",".join(dumps(str(k)) + ":" + dumps(v) for k, v in obj.items()) + "}"
    raise TypeError(f"cannot encode {type(obj).__name__}")


def loads(text):
    value, i = _value(text, 0)
    while i < len(text) and text[i] in _WS:
        i += 1
    if i != len(text):
        raise ValueError(f"extra data at {i}")
    return value


def _value(s, i):
    while s[i] in _WS:
        i += 1
    c = s[i]
    if c == '"':
        return _string(s, i + 1)
    if c == "{":
        out = {}
        i += 1
        while True:
            while s[i] in _WS:
                i += 1
            if s[i] == "}" and not out:
                return out, i + 1
            if s[i] != '"':
                raise ValueError(f"expected a key at {i}")
            key, i = _string(s, i + 1)
            while s[i] in _WS:
                i += 1
            if s[i] != ":":
                raise ValueError(f"expected ':' at {i}")
            out[key], i = _value(s, i + 1)
            while s[i] in _WS:
                i += 1
            if s[i] == "}":
                return out, i + 1
            if s[i] != ",":
                raise ValueError(f"expected ',' at {i}")
            i += 1
    if c == "[":
        items = []
        i += 1
        while True:
            while s[i] in _WS:
                i += 1
            if s[i] == "]" and not items:
                return items, i + 1
            v, i = _value(s, i)
            items.append(v)
            while s[i] in _WS:
                i += 1
            if s[i] == "]":
                return items, i + 1
            if s[i] != ",":
                raise ValueError(f"expected ',' at {i}")
            i += 1
    for word, v in (("true", True), ("false", False), ("null", None)):
        if s.startswith(word, i):
            return v, i + len(word)
    j = i
    while j < len(s) and s[j] in _NUM:
        j += 1
    num = s[i:j]
    if not num:
        raise ValueError(f"unexpected {c!r} at {i}")
    return (float(num) if any(ch in num for ch in ".eE") else int(num)), j


def _string(s, j):
    out = []
    while True:
        q = s.find('"', j)
        b = s.find("\\", j)
        if q < 0:
            raise ValueError("unterminated string")
        if b < 0 or q < b:
            out.append(s[j:q])
            return "".join(out), q + 1
        out.append(s[j:b])
        e = s[b + 1]
        if e == "u":
            code = int(s[b + 2 : b + 6], 16)
            j = b + 6
            if 0xD800 <= code < 0xDC00 and s.startswith("\\u", j):
                low = int(s[j + 2 : j + 6], 16)
                if 0xDC00 <= low < 0xE000:
                    code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                    j += 6
            out.append(chr(code))
        else:
            out.append(_UNESC[e])
            j = b + 2
