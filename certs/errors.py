"""The one exception family raised by the PKI library.

Callers (the CA's RPC edge, the agent) translate these into gRPC statuses or log lines; the
message always says what was wrong with the input, never the input's secret parts.
"""


class CertsError(ValueError):
    """Base class: some PEM, key, CSR, certificate or chain is not acceptable."""


class PemError(CertsError):
    """The bytes are not the PEM object that was expected."""


class KeyMaterialError(CertsError):
    """A private key is unusable: unsupported type, size or curve, or it does not match."""


class SpiffeIdError(CertsError):
    """A string is not a Kubernetes-style SPIFFE identity."""


class CsrError(CertsError):
    """A certificate signing request cannot be parsed or its signature does not verify."""


class ChainError(CertsError):
    """A certificate chain does not verify to the trusted roots at the given time."""


class ChainOrderError(ChainError):
    """A presented chain holds the right certificates in an order the sender must fix."""


class ForeignCertificateError(ChainError):
    """A presented chain holds a certificate that is not on the path to the trusted roots."""
