"""PostgreSQL URLs read before libpq sees them, and shown without their password.

libpq splits ``user:password@host`` at the first ``@`` and refuses a ``%``
not followed by two hex digits, quoting the offending text (the password)
in its error. Python's ``urlsplit`` takes the last ``@``, which is the only
reading under which the host is a host name. So the user name and password
are read here, checked, and written back percent-encoded: libpq then reads
what the person meant, and never echoes a password.
"""

from __future__ import annotations

import re
import urllib.parse

from roomstore.storage.errors import DatabaseConfigError

__all__ = ["masked_url", "normalized_postgres_url"]

_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def masked_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "the database URL"
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return urllib.parse.urlunsplit((parts.scheme, f"{user}:***@{hostport}", parts.path, parts.query, parts.fragment))


def normalized_postgres_url(url: str) -> urllib.parse.SplitResult:
    """``url`` split, its user name and password percent-encoded as libpq
    reads them; ``DatabaseConfigError`` (never showing the password) for one
    that cannot be a URL."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise DatabaseConfigError(f"PostgreSQL URL {masked_url(url)!r}: {exc}") from None
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return parts
    user, colon, password = userinfo.partition(":")
    for name, text in (("user name", user), ("password", password)):
        if _BAD_ESCAPE.search(text):
            raise DatabaseConfigError(
                f"the {name} in PostgreSQL URL {masked_url(url)!r} has a '%' that is not followed by two hex"
                " digits: write a literal '%' as %25"
            )
    quoted = urllib.parse.quote(urllib.parse.unquote(user), safe="")
    if colon:
        quoted += ":" + urllib.parse.quote(urllib.parse.unquote(password), safe="")
    return parts._replace(netloc=f"{quoted}@{hostport}")
