"""``mtplx.request``: SamplerConfig's defaults and validation (an OpenAI-style error naming
the field), and its immutability."""

from __future__ import annotations

import numpy as np
import pytest

from mtplx.errors import InvalidParameter
from mtplx.request import SamplerConfig


def test_sampler_config_defaults_match_openai() -> None:
    config = SamplerConfig()
    assert (config.temperature, config.top_p, config.top_k, config.min_p) == (1.0, 1.0, 0, 0.0)
    assert config.repetition_penalty == 1.0 and not config.logit_bias and config.seed is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 3.0),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("logit_bias", {1: 200.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", [1, 2]),
        ("logit_bias", {"²": 1.0}),  # str.isdigit() is True, int() refuses it
        ("seed", 1.5),
        ("seed", -1),  # numpy.random.default_rng([seed, position]) refuses negatives
    ],
)
def test_invalid_sampler_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidParameter, match=field) as info:
        SamplerConfig(**{field: value})
    assert info.value.param == field and info.value.code == "invalid_value"
    assert isinstance(info.value, ValueError)  # callers catching ValueError still do


def test_sampler_config_accepts_the_largest_int64_seed() -> None:
    seed = 2**63 - 1
    assert SamplerConfig(seed=seed).seed == seed
    np.random.default_rng([seed, 5])  # what the engine does with it


def test_sampler_config_is_frozen() -> None:
    config = SamplerConfig(logit_bias={1: 1.0})
    with pytest.raises(AttributeError):
        config.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.logit_bias[2] = 1.0  # type: ignore[index]
