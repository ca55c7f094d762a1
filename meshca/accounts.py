"""Kubernetes service-account names as text: `ns/sa,…` lists and `system:serviceaccount:NS:SA`.

Both daemons read these shapes (the CA's `--trusted-node-accounts`, the node agent's
`--identities`; usernames in TokenReview answers, JWT subjects, token claims), so each has one
parser here and every caller turns a refusal into its own error type.
"""

from __future__ import annotations

SERVICE_ACCOUNT_USERNAME_PREFIX = "system:serviceaccount:"

Account = tuple[str, str]  # (namespace, service account)


def parse_account_list(text: str, *, comments: bool = False) -> tuple[Account, ...]:
    """`ns/sa,ns/sa` (commas or newlines) → ((ns, sa), ...), deduplicated, in order.

    With `comments`, `#` starts a comment to the end of the line (for files). `ValueError`
    names the first entry that is not `NAMESPACE/SERVICE_ACCOUNT`.
    """
    pairs: dict[Account, None] = {}
    for line in text.splitlines():
        if comments:
            line = line.split("#", 1)[0]
        for item in line.split(","):
            item = item.strip()
            if not item:
                continue
            namespace, sep, account = item.partition("/")
            if not sep or not namespace or not account or "/" in account:
                raise ValueError(f"{item!r} is not NAMESPACE/SERVICE_ACCOUNT")
            pairs[(namespace, account)] = None
    return tuple(pairs)


def account_from_username(username: str) -> Account | None:
    """`system:serviceaccount:NS:SA` → (NS, SA); `None` for any other user name.

    Kubernetes names a service account's user this way in TokenReview answers and in the `sub`
    of its tokens; neither part may be empty or contain a colon.
    """
    if not username.startswith(SERVICE_ACCOUNT_USERNAME_PREFIX):
        return None
    parts = username[len(SERVICE_ACCOUNT_USERNAME_PREFIX) :].split(":")
    if len(parts) != 2 or not all(parts):
        return None
    return parts[0], parts[1]
