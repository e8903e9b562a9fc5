"""The supervisor's dependency-free JSON codec agrees with the standard library's json."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.agent_env.sandbox import jsonwire
from tandem.agent_env.sandbox.inside import jsonlite as supervisor

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=30
)


@settings(max_examples=120, deadline=None)
@given(values)
def test_codec_roundtrips_against_stdlib_json(value: object) -> None:
    assert supervisor.loads(json.dumps(value)) == value  # host -> supervisor (ASCII escapes)
    assert supervisor.loads(json.dumps(value, ensure_ascii=False)) == value
    assert json.loads(supervisor.dumps(value)) == value  # supervisor -> host


@pytest.mark.parametrize("bad", ["", "{", '{"a" 1}', "[1,]", '"open', "tru", "{} x"])
def test_codec_rejects_malformed_json(bad: str) -> None:
    with pytest.raises((ValueError, IndexError)):
        supervisor.loads(bad)


@settings(max_examples=120, deadline=None)
@given(values)
def test_host_encoding_reads_back_on_the_sandbox_side(value: object) -> None:
    line = jsonwire.encode(value).decode()  # the supervisor decodes each line as UTF-8
    assert json.loads(line) == value and supervisor.loads(line) == value


def test_text_that_is_not_utf8_still_reaches_the_sandbox_exactly() -> None:
    req = {"op": "shell", "cmd": "printf '\udcff\udc80' é"}  # bytes a command may carry
    line = jsonwire.encode(req).decode()
    assert json.loads(line) == req and supervisor.loads(line) == req
