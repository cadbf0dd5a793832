"""`keep_alive` as Ollama writes it: seconds or a duration, negative for "until evicted"."""

from __future__ import annotations

import pytest
from marshmallow import ValidationError

from web.schemas import KeepAlive


@pytest.mark.parametrize("value, seconds", [(0, 0.0), (30, 30.0), (2.5, 2.5), ("30", 30.0), ("5m", 300.0),
                                            ("1h30m", 5400.0), ("500ms", 0.5), ("1.5h", 5400.0), (-3, -1.0),
                                            ("-1", -1.0), ("-5m", -1.0)])
def test_numbers_and_durations_load_as_seconds(value, seconds):
    assert KeepAlive().deserialize(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", "m", "5mm", "1e999", "nan", True, [5], {"s": 1}])
def test_anything_else_is_refused(value):
    with pytest.raises(ValidationError):
        KeepAlive().deserialize(value)
