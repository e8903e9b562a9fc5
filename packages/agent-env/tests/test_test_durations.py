"""Test runners' wall-clock durations are taken out of observations (`without_durations`),
for unittest's and pytest's summary lines; nothing else in the text changes."""

from __future__ import annotations

import pytest

from tandem.agent_env.tools import without_durations


@pytest.mark.parametrize(
    ("raw", "kept"),
    [
        (
            "....\n" + "-" * 70 + "\nRan 14 tests in 0.005s\n\nOK\n",
            "....\n" + "-" * 70 + "\nRan 14 tests\n\nOK\n",
        ),
        ("Ran 1 test in 12.250s\n\nFAILED (failures=1)", "Ran 1 test\n\nFAILED (failures=1)"),
        ("Ran 0 tests in 0s\n\nNO TESTS RAN", "Ran 0 tests\n\nNO TESTS RAN"),
        ("..F\n1 failed, 2 passed in 0.12s\n", "..F\n1 failed, 2 passed\n"),
        ("==== 3 passed, 1 warning in 65.01s (0:01:05) ====", "==== 3 passed, 1 warning ===="),
        ("no tests ran in 0.01s", "no tests ran"),
    ],
)
def test_the_runners_durations_are_removed(raw: str, kept: str) -> None:
    assert without_durations(raw) == kept


def test_other_text_is_left_as_it_is() -> None:
    text = (
        'print("Ran 3 laps in 5s")\nassert ran in 0.5s\n'
        "AssertionError: 5 != -1\nit took 2 seconds in 0.5s steps; 4 tests in 3s"
    )
    assert without_durations(text) == text
