"""Logging is configured in one place; JSON lines carry the fields as given."""

from __future__ import annotations

import json

import pytest
import structlog

from kvledger.adapters.structlog_setup import configure_logging
from kvledger.events.keys import hex_keys

pytestmark = pytest.mark.fast


@pytest.fixture
def restore_logging():
    yield
    structlog.reset_defaults()


def test_json_lines_keep_request_keys_and_step_and_drop_lower_levels(capsys, restore_logging):
    configure_logging("warning", json=True)
    log = structlog.get_logger("kvledger.test")
    keys = [bytes([i]) * 36 for i in range(10)]
    log.debug("not_shown", step=1)
    log.warning("load_failed", request_id="req-7", keys=hex_keys(keys), step=12)
    (line,) = capsys.readouterr().err.splitlines()
    record = json.loads(line)
    assert record["event"] == "load_failed" and record["level"] == "warning"
    assert record["request_id"] == "req-7" and record["step"] == 12
    assert record["keys"][:8] == [k.hex() for k in keys[:8]] and record["keys"][8] == "+2 more"
    assert "timestamp" in record

