import io
import json
import logging
from datetime import datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

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


def test_audit_timestamps_are_what_datetime_writes_for_the_same_instant():
    """`_utc_iso` formats each second once and adds the milliseconds; the text must be exactly
    `datetime.isoformat(timespec="milliseconds")`'s, at the edges of a millisecond and a second
    too (where rounding to microseconds carries)."""
    from datetime import UTC

    from meshca.logs import _utc_iso

    instants = [
        0.0,
        1_764_576_000.0,
        1_764_576_000.0005,
        1_764_576_000.9995,
        1_764_576_000.9999995,
        1_764_576_001.0000004,
        2_094_116_819.6229994,
        3_550_325_182.9159994,
    ]
    instants += [1_764_576_000 + n / 997 for n in range(2_000)]
    for instant in instants:
        expected = datetime.fromtimestamp(instant, UTC).isoformat(timespec="milliseconds")
        assert _utc_iso(instant) == expected, instant


def test_audit_line_keys_are_sorted_and_odd_values_written_as_text():
    stream = io.StringIO()
    configure_logging(audit_stream=stream)
    try:
        audit("issued", zeta=1, alpha=None, when=timedelta(seconds=5))
    finally:
        logging.getLogger("meshca.audit").handlers.clear()
    line = stream.getvalue()
    assert line.endswith("}\n") and line.count("\n") == 1
    keys = list(json.loads(line))
    assert keys == sorted(keys) == ["alpha", "msg", "pid", "ts", "when", "zeta"]
    assert json.loads(line)["when"] == "0:00:05"


_JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
    st.timedeltas(),
)


@given(st.dictionaries(st.text(), _JSON_VALUES, max_size=16))
def test_the_audit_encoder_writes_what_json_writes(fields: dict[str, object]) -> None:
    """The audit line's encoder (the C encoder made once) gives `json.dumps`'s text with the
    line's settings: sorted keys, ASCII escapes, NaN and infinities as JSON's extensions,
    other values as their `str`."""
    from meshca.logs import _encode_audit

    expected = json.dumps(fields, sort_keys=True, default=str)
    assert _encode_audit(fields) == expected
