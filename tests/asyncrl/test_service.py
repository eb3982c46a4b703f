"""The error line every service answers a bad body with (asyncrl/service.py validation_message)."""

import pytest
from fastapi.exceptions import RequestValidationError

from asyncrl.protocols.engine import GenerateRequest
from asyncrl.service import MAX_MESSAGE_PART, parse_json, validation_message


def message(raw: bytes) -> str:
    with pytest.raises(RequestValidationError) as refused:
        parse_json(raw, GenerateRequest)
    return validation_message(refused.value)


def test_the_message_names_the_json_field_not_pydantics_union_branch():
    said = message(b'{"input_ids": [1], "sampling_params": {"sampling_seed": -1}}')
    assert said.startswith("sampling_params.sampling_seed: "), said


def test_a_quoted_client_value_is_cut_short():
    said = message(b'{"input_ids": [1], "sampling_params": {"regex": "' + b"x" * 100_000 + b'"}}')
    assert "regex" in said and all(len(part) <= MAX_MESSAGE_PART + 3 for part in said.split("; ")), said[:1000]
