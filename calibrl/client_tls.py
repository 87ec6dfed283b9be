"""The TLS side of calibrl's command-line gRPC clients (``calibrl health``, ``calibrl rubric
reload``): credentials, the channel and the ``--tls-*`` options. Light on purpose: a container's
HEALTHCHECK imports it every few seconds (grpc is imported only when a channel is made)."""

from __future__ import annotations

import pathlib
from typing import Any


def channel_credentials(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> Any:
    """TLS channel credentials (client certificate and key for mutual TLS)."""
    import grpc

    def read(path: str | None) -> bytes | None:
        return pathlib.Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca_file), private_key=read(key_file), certificate_chain=read(cert_file)
    )


def client_channel(target: str, ca_file: str = "", cert_file: str = "", key_file: str = "",
                   server_name: str = "") -> Any:
    """A gRPC channel of a command-line client: TLS when ``ca_file`` is given (``cert_file`` +
    ``key_file``: a client certificate, mutual TLS; ``server_name``: the name checked against the
    server certificate instead of the target's host), plain otherwise."""
    import grpc

    if not ca_file:
        return grpc.insecure_channel(target)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(target, channel_credentials(ca_file, cert_file or None, key_file or None),
                               options=options)


def add_client_tls_options(parser: Any) -> None:
    """The ``--tls-*`` options of a command-line client (see :func:`client_channel`)."""
    parser.add_argument("--tls-ca", default="", help="PEM CA bundle when the server uses TLS")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate, when the server requires mTLS")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", default="",
                        help="name to check the server certificate against (default: the host of --target)")


def check_client_tls_options(parser: Any, args: Any) -> None:
    """Refuse (``parser.error``) ``--tls-*`` options that do not go together."""
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_cert and not args.tls_ca:
        parser.error("--tls-cert (mutual TLS) needs --tls-ca, the CA of the server certificate")


__all__ = ["add_client_tls_options", "channel_credentials", "check_client_tls_options", "client_channel"]
