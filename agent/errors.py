"""Every error the agent raises on purpose, drawn once (as `ca_server.errors` does for the CA).

    AgentError                     anything the agent refuses or cannot do; message says what to fix
    ├── TokenError                 the service-account token cannot be used (never printed)
    │   ├── TokenFileMissing       ... its file does not exist
    │   ├── TokenFileEmpty         ... its file is empty (the kubelet has not written it yet)
    │   └── TokenClaimsError       ... it names no usable service account
    ├── CaClientError              no certificate from the CA; `.retryable`: can trying again help?
    │   ├── CaConnectionError      ... the channel cannot be set up (root or PROV_CERT files)
    │   ├── CaRequestError         ... the CA answered with a gRPC status (`.code`, `.details`)
    │   └── CaResponseError        ... the CA answered with something the agent may not serve
    ├── CertificateRefused         a chain fails `agent.acceptance` (identity, key, roots, window)
    ├── CertificateNotRestored     a previous run's files are not served again (`agent.cert_state`)
    │   └── NoPreviousCertificate  ... there are none (a first start)
    ├── FileSecretError            mounted or `file-cert:` files refused (`agent.file_mounted`)
    ├── TrustBundleRefused         a trust bundle not served: not PEM, no CA certificate, expired
    ├── UnknownResourceError       an SDS name this agent cannot serve (also a ValueError)
    │   └── UnknownFileResourceError  ... a malformed `file-cert:`/`file-root:` name
    ├── CallerNotAttested          a Workload API caller the node agent cannot place in a pod
    ├── SocketPathRefused          a socket path not served on: another process's, or not a
    │                              socket (`agent.unix_socket`; also a FileExistsError)
    └── AgentFailed                a background worker died: the agent stops, exit status 1

`agent.config.ConfigError` (a bad flag or environment variable) is separate: it is raised while
the configuration is built, before any of the parts above exist, and the command turns it into
exit status 2.

Who catches what: the scheduler (`agent.scheduler`) catches every failure of one attempt,
records its message for readiness and retries with backoff, so none of these ends the agent;
the file watchers log `FileSecretError` and keep the previous secret (so does
`agent.trust_bundle` with `TrustBundleRefused`); the SDS server answers
`UnknownResourceError` with INVALID_ARGUMENT on that stream only; the Workload API
(`agent.workload.api`) answers `CallerNotAttested` with PERMISSION_DENIED; `SocketPathRefused` at
start-up becomes `AgentFailed` naming the flag (`agent.main`); `AgentFailed` is the one that
ends the process. Messages name files,
identities and checks, never key material or tokens.
"""

from __future__ import annotations

import grpc

RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
    }
)
"""CA statuses worth retrying at once: the CA is busy, restarting or unreachable."""


class AgentError(Exception):
    """Root of the agent's own errors."""


class TokenError(AgentError):
    """The token cannot be used; the message says why and what to check (never the token)."""


class TokenFileMissing(TokenError):
    pass


class TokenFileEmpty(TokenError):
    pass


class TokenClaimsError(TokenError):
    pass


class CaClientError(AgentError):
    """Any failure to obtain a certificate from the CA. `retryable`: can trying again help?"""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class CaConnectionError(CaClientError):
    """The channel cannot be set up (e.g. the root file to verify the CA is missing)."""


class CaRequestError(CaClientError):
    """The CA answered with a gRPC error status. `retry_after`: the CA's hint (seconds, from
    the `grpc-retry-pushback-ms` trailer of a shed request) of when trying again can succeed."""

    def __init__(
        self, code: grpc.StatusCode, details: str, *, retry_after: float | None = None
    ) -> None:
        super().__init__(f"CA returned {code.name}: {details}", retryable=code in RETRYABLE_CODES)
        self.code = code
        self.details = details
        self.retry_after = retry_after


class CaResponseError(CaClientError):
    """The CA answered, but with something that is not a usable certificate for us."""


class CertificateRefused(AgentError):
    """A certificate chain is not one the agent may serve (for its identity and key)."""


class CertificateNotRestored(AgentError):
    """Why the files of a previous run are not served; names files and checks, never content."""


class NoPreviousCertificate(CertificateNotRestored):
    """The directory holds none of the three files: a first start, nothing to restore."""


class FileSecretError(AgentError):
    """Why a set of files was refused; the message names files and reasons, never content."""


class TrustBundleRefused(AgentError):
    """A trust bundle (the root file or a CA answer's roots) the agent will not serve; the
    previous bundle stays (`agent.trust_bundle`)."""


class UnknownResourceError(AgentError, ValueError):
    """A requested resource name this agent cannot serve (e.g. a malformed `file-cert:` name)."""


class UnknownFileResourceError(UnknownResourceError):
    """A malformed `file-cert:` / `file-root:` resource name."""


class CallerNotAttested(AgentError):
    """A Workload API caller the node agent cannot tie to a live pod on its node
    (`agent.workload.attestor`); the message says which step failed (peer credentials, the
    process: unreadable, or not proven to be the one that connected
    (`agent.workload.peer_process`), its cgroup, the pod) so the operator knows what to fix.
    `reason` is the metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class SocketPathRefused(AgentError, FileExistsError):
    """A Unix socket path the agent will not serve on (`agent.unix_socket`): something other
    than a socket, or a socket another process answers on (or that cannot be probed). The path
    is left as it was; the message names it and what to do."""


class AgentFailed(AgentError):
    """A background worker (certificate rotation) died, or a part could not start (a socket
    or directory that cannot be made): the agent cannot keep its certificates fresh, so it
    stops and exits non-zero for its supervisor to restart it."""
