"""The supervisor's dependency-free JSON codec agrees with the standard library's json."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.agent_env._sandbox import jsonlite as supervisor

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
