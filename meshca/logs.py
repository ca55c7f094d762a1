"""Logging setup shared by the daemons: plain operational lines on stderr, and a dedicated
`meshca.audit` logger whose records are single JSON objects (one per issuance or denial).

Nothing logged anywhere may contain a token or key: callers pass identities, serials and reasons,
never request bodies or headers.

The audit line is on the CA's per-certificate path, so `audit()` skips the generic machinery
(LogRecord, caller lookup by stack walk, formatter dispatch) when every audit handler is the
`AuditStreamHandler` installed here: it formats the same JSON and writes it with one `write`
and a flush, under the handler's lock. One line per decision, none held in a buffer, so a
SIGTERM (or SIGKILL) loses none already decided. Handlers of other kinds get ordinary records.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, cast

AUDIT_LOGGER = "meshca.audit"


# One encoder for every line: `json.dumps` with options builds a new encoder per call, and so
# does `JSONEncoder.encode` (its C encoder, inside `iterencode`).
_AUDIT_ENCODER = json.JSONEncoder(sort_keys=True, default=str)


def _c_audit_encoder() -> Callable[[dict[str, Any]], str] | None:
    """`_AUDIT_ENCODER.encode` with its C encoder made once (the same settings, the same text;
    without circular-reference bookkeeping, as a line's fields are flat values), or `None`
    where Python's json module has no C accelerator."""
    make_encoder = getattr(json.encoder, "c_make_encoder", None)
    if make_encoder is None:
        return None
    encode = make_encoder(
        None,  # markers: no circular-reference check
        str,  # default=str
        json.encoder.encode_basestring_ascii,  # ensure_ascii=True
        None,  # indent
        ": ",  # key separator
        ", ",  # item separator
        True,  # sort_keys
        False,  # skipkeys
        True,  # allow_nan
    )
    return lambda fields: "".join(encode(fields, 0))


_encode_audit = _c_audit_encoder() or _AUDIT_ENCODER.encode


def _audit_json(created: float, event: str, pid: int | None, fields: dict[str, Any]) -> str:
    # `pid` tells apart the workers of `meshca ca --workers N`, which share stdout.
    return _encode_audit({"ts": _utc_iso(created), "msg": event, "pid": pid, **fields})


class _AuditFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "audit", {}) or {}
        return _audit_json(record.created, record.getMessage(), record.process, fields)


class AuditStreamHandler(logging.StreamHandler):
    """Writes audit lines to a stream; `write_audit` is the direct path `audit()` takes."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.setFormatter(_AuditFormatter())
        self._pid = os.getpid()

    def write_audit(self, event: str, fields: dict[str, Any]) -> None:
        line = _audit_json(time.time(), event, self._pid, fields) + self.terminator
        with self.lock or contextlib.nullcontext():
            self.stream.write(line)
            self.stream.flush()


def _utc_iso(created: float) -> str:
    """ISO 8601 in UTC with milliseconds: sortable and unambiguous across nodes.

    The date and time up to the second are formatted once per second (a CA writes hundreds of
    lines a second); the same text `datetime.isoformat(timespec="milliseconds")` gives."""
    global _second_text
    fraction, whole = math.modf(created)  # split as `datetime.fromtimestamp` does
    second, micro = divmod(int(whole) * 1_000_000 + round(fraction * 1e6), 1_000_000)
    cached_second, text = _second_text
    if cached_second != second:
        text = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _second_text = (second, text)
    return f"{text}.{micro // 1000:03d}+00:00"


# (unix second, its "YYYY-MM-DDTHH:MM:SS"): replaced whole, so threads never see half of it.
_second_text: tuple[int, str] = (-1, "")


def configure_logging(level: str = "INFO", audit_stream: Any = None) -> None:
    """Installs the handlers once per process; safe to call again (it replaces them)."""
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    audit = logging.getLogger(AUDIT_LOGGER)
    audit.handlers.clear()
    audit.addHandler(AuditStreamHandler(audit_stream or sys.stdout))
    audit.setLevel(logging.INFO)
    audit.propagate = False


_audit_logger = logging.getLogger(AUDIT_LOGGER)


def audit(event: str, **fields: Any) -> None:
    """Emits one JSON audit line: `{"msg": event, ...fields}`."""
    handlers = _audit_logger.handlers
    if (
        handlers
        and _audit_logger.isEnabledFor(logging.INFO)
        and all(type(h) is AuditStreamHandler for h in handlers)
    ):
        for handler in handlers:
            cast(AuditStreamHandler, handler).write_audit(event, fields)
        return
    _audit_logger.info(event, extra={"audit": fields})
