"""Every public setting under hostile values: each `FSDP2Config` field and each `HF_FSDP2_<FIELD>`
environment variable either takes the value or raises one ValueError/TypeError naming the field (or
the variable): never another exception type (an overflow, a division by zero, an attribute error
deep inside), never a silent garbage setting."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hf_fsdp2 import FSDP2Config
from hf_fsdp2.integrations.accelerate import ENV_PREFIX, env_overrides

FIELDS = [f.name for f in dataclasses.fields(FSDP2Config)]
HOSTILE = [object(), "\x00", "nan", float("nan"), float("inf"), -1, 10 ** 30, [], {}, "9" * 400, True, ""]


def _names(message: str, field: str) -> bool:
    return field in message or field.upper() in message


@pytest.mark.parametrize("field", FIELDS)
def test_every_config_field_takes_or_names_each_hostile_value(field):
    bad = []
    for value in HOSTILE:
        try:
            config = FSDP2Config.from_dict({field: value}, source="test")
        except (ValueError, TypeError) as e:
            if not _names(str(e), field):
                bad.append(f"{value!r}: {type(e).__name__} without the field name: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - any other type is the bug this test is for
            bad.append(f"{value!r}: {type(e).__name__}: {e}")
            continue
        taken = getattr(config, field)
        if isinstance(taken, float) and math.isnan(taken):
            bad.append(f"{value!r}: accepted as NaN")
        if taken is value and isinstance(value, (list, dict)) or type(taken) is object:
            bad.append(f"{value!r}: accepted unchecked")
    assert not bad, f"FSDP2Config.{field}:\n" + "\n".join(bad)


@pytest.mark.parametrize("field", FIELDS)
def test_every_environment_variable_takes_or_names_each_hostile_string(field):
    variable = ENV_PREFIX + field.upper()
    bad = []
    for value in ("\x00", "nan", "inf", "-1", "9" * 400, "", "[]", "{}", "yes please"):
        try:
            env_overrides({variable: value})
        except ValueError as e:
            if not _names(str(e), field):
                bad.append(f"{value!r}: error without the field or variable name: {e}")
        except Exception as e:  # noqa: BLE001
            bad.append(f"{value!r}: {type(e).__name__}: {e}")
    assert not bad, f"{variable}:\n" + "\n".join(bad)


@pytest.mark.parametrize("value", ["two", "0", "-1", "999999"])
def test_generation_memory_budget_names_a_bad_local_world_size(monkeypatch, value):
    import torch

    from hf_fsdp2.sharding import generation

    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        generation.free_memory(torch.device("cpu"))
