"""Why a gRPC endpoint refuses a client's connection when TLS is the cause: the endpoint serves TLS and the client
speaks plain gRPC, the reverse, or the client trusts another certificate than the one the endpoint serves.

gRPC reports each as UNAVAILABLE with a detail that names no fix ("Socket closed" for a plain client at a TLS
endpoint), so `mismatch` asks the endpoint itself: one TLS handshake trusting anything, one trusting the client's
certificate.
"""

from __future__ import annotations

import socket
import ssl

FIX_PLAIN = "give the endpoint's certificate: --tls-cert PEM (default GRADSYNC_TLS_CERT), or Client(root_cert=PEM)"


def mismatch(address: str, root_cert: str | None, timeout: float) -> str | None:
    """Why a client trusting `root_cert` (None: a plain gRPC client) cannot talk to the endpoint at `address`
    ("host:port") because of TLS, with the fix; None when TLS is not why (or the endpoint cannot be reached)."""
    serves_tls = _handshake(address, None, timeout)
    if serves_tls is None:
        return None
    if root_cert is None:
        return f"the endpoint serves TLS and this client speaks plain gRPC: {FIX_PLAIN}" if serves_tls else None
    if not serves_tls:
        return (
            f"the endpoint serves plain gRPC, without TLS, and this client speaks TLS (certificate {root_cert}): "
            "leave out --tls-cert and unset GRADSYNC_TLS_CERT (Client(root_cert=None))"
        )
    if _handshake(address, root_cert, timeout) is False:
        return (
            f"the endpoint's TLS certificate is not signed by {root_cert}, the certificate this client trusts: "
            "give the certificate the endpoint serves (the GRADSYNC_TLS_CERT of its job)"
        )
    return None


def _handshake(address: str, root_cert: str | None, timeout: float) -> bool | None:
    """Whether a TLS handshake with `address` succeeds, trusting `root_cert` only (None: trusting any
    certificate); None when no TCP connection opens."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.set_alpn_protocols(["h2"])  # what a gRPC client offers
    if root_cert is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context.load_verify_locations(root_cert)
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout)
    except (OSError, ValueError):
        return None
    try:
        with context.wrap_socket(raw, server_hostname=host):
            return True
    except (OSError, ssl.SSLError):  # refused (not TLS, or not the certificate), or closed in the handshake
        return False
    finally:
        raw.close()
