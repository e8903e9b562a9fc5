"""`GRPOStep` is the trainer step's name; `GRPOTrainer` (TRL's name for a generate-and-train
loop) is a deprecated alias for one release."""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

import tandem.grpo
import tandem.grpo.trainer

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("module", [tandem.grpo, tandem.grpo.trainer])
def test_old_name_is_a_deprecated_alias_of_grpo_step(module: object) -> None:
    with pytest.warns(DeprecationWarning, match="GRPOTrainer is deprecated.*GRPOStep"):
        old = module.GRPOTrainer  # type: ignore[attr-defined]
    assert old is tandem.grpo.trainer.GRPOStep
    assert tandem.grpo.GRPOStep is tandem.grpo.trainer.GRPOStep


def test_from_import_of_the_old_name_warns() -> None:
    with pytest.warns(DeprecationWarning, match="GRPOStep"):
        from tandem.grpo import GRPOTrainer  # noqa: F401


def test_public_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        names = {}
        exec("from tandem.grpo import *", names)
        module = importlib.import_module("tandem.grpo")
        for name in module.__all__:
            getattr(module, name)
    assert "GRPOStep" in names and "GRPOTrainer" not in names


def test_readme_uses_public_names_and_maps_trl_and_verl_terms() -> None:
    text = README.read_text()
    imported = re.findall(r"from tandem\.grpo import ([^\n]+)", text)
    names = {n.strip() for line in imported for n in line.split(",")}
    assert names and names <= set(tandem.grpo.__all__), names - set(tandem.grpo.__all__)
    assert "## If you come from TRL or verl" in text
    table = text.split("## If you come from TRL or verl", 1)[1]
    for term in ("epsilon_high", "loss_type", "loss_agg_mode", "norm_adv_by_std_in_grpo"):
        assert term in table, term
