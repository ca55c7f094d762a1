import io
import json
import logging
from datetime import datetime, timedelta

from meshca.logs import audit, configure_logging


def test_audit_lines_are_single_json_objects_with_an_iso_utc_timestamp():
    stream = io.StringIO()
    configure_logging(audit_stream=stream)
    try:
        audit("issued", identity="spiffe://cluster.local/ns/a/sa/b", granted_ttl_seconds=600)
        audit("denied", reason="jwt-expired")
    finally:
        logging.getLogger("meshca.audit").handlers.clear()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["msg"] for line in lines] == ["issued", "denied"]
    assert lines[0]["granted_ttl_seconds"] == 600
    assert datetime.fromisoformat(lines[0]["ts"]).utcoffset() == timedelta(0)
