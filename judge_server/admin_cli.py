"""`calibrl rubric reload`: ask a running judge server to reread its rubric folder now.

It calls the ReloadRubrics admin RPC (docs/concepts/rubric-lifecycle.md) and prints what the
reread changed, one line per rubric version: ``loaded`` (now current), ``refused`` (with why; the
current version keeps serving), ``removed`` (its file is gone) or ``retired`` (its retention
ended). The key must be one of a tenant listed in the server's ``rubric_admin_tenants``.

Exit code 0 when the call succeeded and nothing was refused, 1 when a version was refused (so a
publishing script stops there), 2 when the call itself failed: the server cannot be reached, the
key is missing or wrong, the tenant may not reload, or the server has no rubric folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from calibrl.client_tls import add_client_tls_options, check_client_tls_options, client_channel

_ADVICE = {
    "UNAVAILABLE": "is the judge server running there? (calibrl health --target {target})",
    "UNAUTHENTICATED": "give the API key of a tenant listed in the server's rubric_admin_tenants, with --api-key "
                       "or CALIBRL_API_KEY",
    "PERMISSION_DENIED": "",
    "DEADLINE_EXCEEDED": "no answer within --timeout {timeout:g} s; the reread probes every changed version, raise "
                         "--timeout if the folder is large",
}


def reload_rubrics(target: str, api_key: str = "", timeout_s: float = 60.0, ca_file: str = "", cert_file: str = "",
                   key_file: str = "", server_name: str = "") -> list[dict[str, Any]]:
    """The changes of one ReloadRubrics call to ``target`` (raises grpc.RpcError when it fails).

    ``api_key`` is sent as ``authorization: Bearer <key>``; ``ca_file`` turns TLS on, ``cert_file`` +
    ``key_file`` present a client certificate (mutual TLS), ``server_name`` overrides the name checked
    against the server certificate."""
    import grpc

    from calibrl.v1 import judge_pb2, judge_pb2_grpc

    channel = client_channel(target, ca_file, cert_file, key_file, server_name)
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    with channel:
        reply = judge_pb2_grpc.JudgeServiceStub(channel).ReloadRubrics(
            judge_pb2.ReloadRubricsRequest(), timeout=timeout_s, metadata=metadata, wait_for_ready=False)
    return [{"rubric_id": c.rubric_id, "action": c.action, "hash": c.hash, "version": c.version,
             "reason": c.reason, "source": c.source} for c in reply.changes]


def format_change(change: dict[str, Any]) -> str:
    """One change as a line: action, rubric id, version (hash prefix and label), why."""
    version = f"{change['hash'][:12]} (version {change['version']})" if change["hash"] else "(unreadable file)"
    return f"{change['action']:<8} {change['rubric_id']} {version}: {change['reason']}"


def reload(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="calibrl rubric reload", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50052", help="host:port of the judge server")
    parser.add_argument("--api-key", default="",
                        help="API key of a tenant in the server's rubric_admin_tenants (or CALIBRL_API_KEY)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the reread (60)")
    parser.add_argument("--json", action="store_true", help="print the changes as one JSON list instead of lines")
    add_client_tls_options(parser)
    args = parser.parse_args(argv)
    check_client_tls_options(parser, args)
    if not args.timeout > 0:
        parser.error(f"--timeout {args.timeout}: must be > 0 seconds")
    api_key = args.api_key or os.environ.get("CALIBRL_API_KEY", "")
    import grpc

    try:
        changes = reload_rubrics(args.target, api_key, args.timeout, args.tls_ca, args.tls_cert, args.tls_key,
                                 args.tls_server_name)
    except OSError as exc:
        print(f"error: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        code = exc.code().name
        advice = _ADVICE.get(code, "").format(target=args.target, timeout=args.timeout)
        if code == "UNAUTHENTICATED" and not api_key:
            advice = "the server requires an API key: " + advice
        print(f"error: ReloadRubrics at {args.target}: {code}: {exc.details()}" + (f"; {advice}" if advice else ""),
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(changes, indent=1))
    else:
        for change in changes:
            print(format_change(change))
        counts = {a: sum(c["action"] == a for c in changes) for a in ("loaded", "refused", "removed", "retired")}
        summary = ", ".join(f"{n} {a}" for a, n in counts.items() if n)
        print(f"{args.target}: " + (summary if changes else "no change (the folder holds the served versions)"))
    return 1 if any(c["action"] == "refused" for c in changes) else 0


if __name__ == "__main__":
    sys.exit(reload(sys.argv[1:]))
