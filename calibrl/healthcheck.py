"""`calibrl health`: ask a server over the gRPC health protocol whether it serves.

Exit code 0 when the named service (default: the whole server) is SERVING, 1
otherwise. Used by the Docker HEALTHCHECKs, the compose file and the demo.
"""

from __future__ import annotations

import argparse
import sys

from calibrl.client_tls import add_client_tls_options, check_client_tls_options, client_channel


def check(target: str, service: str = "", timeout_s: float = 3.0, ca_file: str = "", cert_file: str = "",
          key_file: str = "", server_name: str = "") -> str:
    """The serving status name of ``service`` at ``target`` (raises grpc.RpcError when unreachable).

    ``ca_file`` turns TLS on; ``cert_file`` + ``key_file`` present a client certificate (mutual TLS);
    ``server_name`` overrides the name checked against the server certificate.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = client_channel(target, ca_file, cert_file, key_file, server_name)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="calibrl health", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server")
    parser.add_argument("--service", default="", help="e.g. calibrl.v1.RetrievalService; empty: the whole server")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    add_client_tls_options(parser)
    args = parser.parse_args(argv)
    check_client_tls_options(parser, args)
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
