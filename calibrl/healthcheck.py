"""`calibrl health`: ask a server over the gRPC health protocol whether it serves.

Exit code 0 when the named service (default: the whole server) is SERVING, 1
otherwise. Used by the Docker HEALTHCHECKs, the compose file and the demo.
"""

from __future__ import annotations

import argparse
import sys


def check(target: str, service: str = "", timeout_s: float = 3.0, ca_file: str = "", cert_file: str = "",
          key_file: str = "", server_name: str = "") -> str:
    """The serving status name of ``service`` at ``target`` (raises grpc.RpcError when unreachable).

    ``ca_file`` turns TLS on; ``cert_file`` + ``key_file`` present a client certificate (mutual TLS);
    ``server_name`` overrides the name checked against the server certificate.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if ca_file:
        from calibrl.security import channel_credentials

        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(target, channel_credentials(ca_file, cert_file or None, key_file or None),
                                      options=options)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="calibrl health", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server")
    parser.add_argument("--service", default="", help="e.g. calibrl.v1.RetrievalService; empty: the whole server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--tls-ca", default="", help="PEM CA bundle when the server uses TLS")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate, when the server requires mTLS")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", default="",
                        help="name to check the server certificate against (default: the host of --target)")
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_cert and not args.tls_ca:
        parser.error("--tls-cert (mutual TLS) needs --tls-ca, the CA of the server certificate")
    import grpc

    try:
        status = check(args.target, args.service, args.timeout, args.tls_ca, args.tls_cert, args.tls_key,
                       args.tls_server_name)
    except OSError as exc:
        print(f"{args.target}: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"{args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"{args.target} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
