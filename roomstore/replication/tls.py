"""TLS for replication across machines: the TCP listener, its workers, Redis.

Certificates and keys are PEM files. A server needs its certificate and key
(:func:`server_tls`); a client names the CA that signed the server's
certificate, or trusts the system's roots without one, and may present a
certificate of its own (:class:`ClientTLS`). A client checks the server's
name (a DNS name or an IP address, as given in ``--server`` or the Redis URL)
against the certificate. Twisted's TLS (pyOpenSSL, service_identity) does the
work; a file that cannot be read or parsed is a :class:`TLSConfigError` with
one line saying which.

Loopback addresses are the only ones a replication server may listen on
without protection: :func:`check_bind_protected`.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import attrs

__all__ = ["ClientTLS", "TLSConfigError", "check_bind_protected", "is_loopback", "redis_client_tls", "server_tls"]


class TLSConfigError(ValueError):
    """A certificate, key or CA file cannot be used; the message says which."""


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise TLSConfigError(f"cannot read the {what} {path}: {exc.strerror}") from None


def _private_certificate(cert_file: str, key_file: str) -> Any:
    from twisted.internet.ssl import PrivateCertificate

    pem = _read(cert_file, "certificate") + b"\n" + _read(key_file, "key")
    try:
        return PrivateCertificate.loadPEM(pem)
    except Exception as exc:
        raise TLSConfigError(
            f"certificate {cert_file} with key {key_file} cannot be used ({type(exc).__name__}:"
            f" {exc or 'not PEM, or the key does not match'})"
        ) from None


def server_tls(cert_file: str, key_file: str) -> Any:
    """Context options for a TLS listener serving ``cert_file``/``key_file``."""
    return _private_certificate(cert_file, key_file).options()


@attrs.frozen
class ClientTLS:
    """A TLS client's files: ``ca_file`` (None: the system's trusted roots)
    and an optional client certificate with its key."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise TLSConfigError("a client certificate needs both its certificate file and its key file")

    def options(self, hostname: str) -> Any:
        """Connection options for a server named ``hostname`` (checked against its certificate)."""
        from twisted.internet.ssl import Certificate, optionsForClientTLS, platformTrust

        if self.ca_file is not None:
            try:
                trust = Certificate.loadPEM(_read(self.ca_file, "CA certificate"))
            except TLSConfigError:
                raise
            except Exception as exc:
                raise TLSConfigError(f"CA certificate {self.ca_file} cannot be used ({exc or 'not PEM'})") from None
        else:
            trust = platformTrust()
        client = None if self.cert_file is None else _private_certificate(self.cert_file, self.key_file or "")
        return optionsForClientTLS(hostname, trustRoot=trust, clientCertificate=client)


def redis_client_tls(
    url: str | None, ca_file: str | None, cert_file: str | None, key_file: str | None
) -> ClientTLS | None:
    """The ``ClientTLS`` of the ``--redis-ca``/``--redis-cert``/``--redis-key``
    options (None without them), which need a ``rediss://`` URL."""
    if not (ca_file or cert_file or key_file):
        return None
    if not (url or "").startswith("rediss://"):
        raise TLSConfigError("--redis-ca, --redis-cert and --redis-key are for TLS: give --redis rediss://HOST:PORT")
    if (cert_file is None) != (key_file is None):
        raise TLSConfigError("a Redis client certificate needs both --redis-cert and --redis-key")
    return ClientTLS(ca_file, cert_file, key_file)


def is_loopback(address: str) -> bool:
    """Whether a listening address reaches this machine only."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_bind_protected(bind: str, secret: bool, tls: bool) -> None:
    """Refuse to serve replication beyond this machine with neither a shared
    secret nor TLS: every event of every room would go to whoever connects,
    in plaintext."""
    if not secret and not tls and not is_loopback(bind):
        raise TLSConfigError(
            f"refusing to serve replication on {bind}, which is not loopback, to anyone who connects in plaintext:"
            " add --secret-file FILE (workers send it) and --tls-cert FILE --tls-key FILE (workers add --tls-ca),"
            " or bind 127.0.0.1"
        )
