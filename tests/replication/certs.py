"""Certificates a test makes with ``openssl``: a CA, a server certificate for
``localhost`` and ``127.0.0.1`` signed by it, a client certificate signed by it,
and a second CA that signed neither (to see a server refused)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import attrs


@attrs.frozen
class Certs:
    directory: str
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(name: str, cwd: str) -> None:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        cwd=cwd,
    )


def _signed(name: str, ca: str, extensions: str, cwd: str) -> None:
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        cwd=cwd,
    )
    with open(os.path.join(cwd, f"{name}.ext"), "w") as handle:
        handle.write(extensions)
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.pem",
        cwd=cwd,
    )


def make_certs(test) -> Certs:
    """Fresh certificates in a temporary folder, removed after ``test``."""
    if shutil.which("openssl") is None:
        test.fail("no openssl: apt-get install openssl")
    directory = tempfile.mkdtemp(prefix="roomstore-certs-")
    test.addCleanup(shutil.rmtree, directory, True)
    _ca("ca", directory)
    _ca("otherca", directory)
    _signed("server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n", directory)
    _signed("client", "ca", "extendedKeyUsage=clientAuth\n", directory)
    path = lambda name: os.path.join(directory, name)  # noqa: E731
    return Certs(
        directory,
        path("ca.pem"),
        path("server.pem"),
        path("server.key"),
        path("client.pem"),
        path("client.key"),
        path("otherca.pem"),
    )
