"""Shared state between ``KubeApiServer`` and its request handlers."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .faults import FaultPlan
from .issuer import ServiceAccountIssuer
from .recorder import RequestRecorder
from .store import Store
from .tokens import TokenAuthority


@dataclass
class Backend:
    """Everything a request handler needs; owned by ``KubeApiServer``."""

    store: Store
    tokens: TokenAuthority
    recorder: RequestRecorder
    issuer: ServiceAccountIssuer = field(default_factory=ServiceAccountIssuer)
    auth_token: str | None = None
    watch_timeout: float = 60.0
    # Seconds every list waits before it is answered (a slow API server, for stop tests).
    list_delay: float = 0.0
    stopping: threading.Event = field(default_factory=threading.Event)
    faults: FaultPlan = field(default_factory=FaultPlan)
