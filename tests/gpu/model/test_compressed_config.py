"""A compressed-tensors config with a value of the wrong type or out of range is one clear line.

Before: ``group_size`` 2^40 tried to allocate a petabyte, 64.0 or ``num_bits: null`` or
``config_groups`` as a list were tracebacks. Now each is a ValueError naming the field, which the
engine reports as its one start-failure line (no traceback for a ValueError).
"""

from __future__ import annotations

import json

import pytest

from tidal.gpu.model.compressed import CompressedCheckpoint

GOOD_WEIGHTS = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}


def _config(tmp_path, weights=None, groups=None) -> str:
    groups = groups if groups is not None else {"group_0": {"weights": weights, "targets": ["Linear"]}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": groups}}))
    return str(tmp_path)


@pytest.mark.parametrize("weights, field", [
    ({**GOOD_WEIGHTS, "group_size": 2**40}, "group_size"),
    ({**GOOD_WEIGHTS, "group_size": 64.0}, "group_size"),
    ({**GOOD_WEIGHTS, "num_bits": None}, "num_bits"),
    ({**GOOD_WEIGHTS, "symmetric": "yes"}, "symmetric"),
])
def test_a_bad_value_is_one_line_naming_it(tmp_path, weights, field):
    with pytest.raises(ValueError) as info:
        CompressedCheckpoint.read(_config(tmp_path, weights))
    message = str(info.value)
    assert message.startswith("bad compressed-tensors config") and field in message and "\n" not in message


def test_config_groups_as_a_list_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="config_groups must map names to groups"):
        CompressedCheckpoint.read(_config(tmp_path, groups=[{"weights": GOOD_WEIGHTS}]))


def test_the_good_scheme_still_reads(tmp_path):
    checkpoint = CompressedCheckpoint.read(_config(tmp_path, GOOD_WEIGHTS))
    assert checkpoint.bits == 4 and checkpoint.group_size == 128
