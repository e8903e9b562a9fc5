"""`GRPOConfig` checks every setting when it is built, not at the first loss call."""

from __future__ import annotations

from typing import get_args

import msgspec
import pytest

from tandem.grpo import GRPOConfig, GRPOError
from tandem.grpo.config import ISMode, KLEstimator, KLPlacement, LossAggregation, RatioLevel

ENUMS = {
    "loss_agg": LossAggregation,
    "is_mode": ISMode,
    "kl_estimator": KLEstimator,
    "ratio_level": RatioLevel,
    "kl_placement": KLPlacement,
}


@pytest.mark.parametrize("field", sorted(ENUMS))
@pytest.mark.parametrize("value", ["nope", "K1", "", None, 1])
def test_bad_enum_setting_fails_at_construction_naming_the_choices(
    field: str, value: object
) -> None:
    with pytest.raises(GRPOError) as info:
        GRPOConfig(**{field: value})
    message = str(info.value)
    assert f"GRPOConfig.{field}=" in message
    for allowed in get_args(ENUMS[field]):
        assert repr(allowed) in message


@pytest.mark.parametrize("field", sorted(ENUMS))
def test_every_allowed_enum_value_constructs(field: str) -> None:
    for allowed in get_args(ENUMS[field]):
        assert getattr(GRPOConfig(**{field: allowed}), field) == allowed


def test_decoding_still_rejects_unknown_values_and_fields() -> None:
    assert msgspec.convert({"loss_agg": "token-mean"}, GRPOConfig).loss_agg == "token-mean"
    with pytest.raises(msgspec.ValidationError, match="loss_agg"):
        msgspec.convert({"loss_agg": "nope"}, GRPOConfig)
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"beta": 0.1}, GRPOConfig)
