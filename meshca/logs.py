"""Logging setup shared by the daemons: plain operational lines on stderr, and a dedicated
`meshca.audit` logger whose records are single JSON objects (one per issuance or denial).

Nothing logged anywhere may contain a token or key: callers pass identities, serials and reasons,
never request bodies or headers.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

AUDIT_LOGGER = "meshca.audit"


class _AuditFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "audit", {}) or {}
        return json.dumps(
            {"ts": _utc_iso(record.created), "msg": record.getMessage(), **fields},
            sort_keys=True,
            default=str,
        )


def _utc_iso(created: float) -> str:
    """ISO 8601 in UTC with milliseconds: sortable and unambiguous across nodes."""
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")


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
    audit_handler = logging.StreamHandler(audit_stream or sys.stdout)
    audit_handler.setFormatter(_AuditFormatter())
    audit.addHandler(audit_handler)
    audit.setLevel(logging.INFO)
    audit.propagate = False


def audit(event: str, **fields: Any) -> None:
    """Emits one JSON audit line: `{"msg": event, ...fields}`."""
    logging.getLogger(AUDIT_LOGGER).info(event, extra={"audit": fields})
