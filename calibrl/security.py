"""Authentication, tenancy and per-tenant limits for both services.

- TLS: :func:`server_credentials` builds grpc server credentials from PEM files
  (mutual TLS when a client CA is given); :func:`channel_credentials` is the client side.
- API keys: callers send ``authorization: Bearer <key>`` (or ``x-api-key: <key>``)
  as call metadata. The keys file holds only SHA-256 digests of keys, each bound to
  a tenant and that tenant's limits; raw keys never reach a file or a log.
- :class:`AuthInterceptor` checks the key of every call except health checking and
  reflection (probes must work without a key), enforces the tenant's request-size
  and rate limits, and runs the handler with :func:`current_tenant` set, so a
  servicer can restrict what the tenant sees (the judge shows a tenant only its own
  rubrics). It decides from the call's metadata alone: an unknown key or a tenant
  over its rate is refused before the request body is read, and a body over the
  tenant's size limit is refused before it is parsed, so refused calls cost no memory.
- Fair shares: a tenant's ``weight`` is its share of a busy server against the other
  tenants with work queued (``calibrl.batching``); :func:`tenant_weights` reads them.

Keys file (YAML)::

    tenants:
      - name: search-team
        key_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
        max_request_bytes: 1048576    # optional, default: no per-tenant limit
        rate_per_second: 50           # optional token bucket, default: unlimited
        burst: 100                    # optional, default: 2 x rate
        weight: 2                     # optional share of a busy server (weighted fair queueing), default 1

``python -c "import hashlib,sys; print(hashlib.sha256(sys.argv[1].encode()).hexdigest())" KEY``
prints a key's digest.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import pathlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import yaml

from calibrl import telemetry
from calibrl.client_tls import channel_credentials
from calibrl.errors import ConfigError
from calibrl.serving import end_call

_current_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("calibrl_tenant", default=None)

# Calls to these services never need a key (load balancer probes, grpcurl discovery).
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


def current_tenant() -> str | None:
    """The tenant of the call being handled; None when no API keys are configured."""
    return _current_tenant.get()


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Tenant:
    name: str
    key_sha256: str
    max_request_bytes: int | None = None
    rate_per_second: float | None = None
    burst: float | None = None
    weight: float = 1.0


def tenant_weights(path: str | pathlib.Path | None) -> dict[str, float]:
    """Tenant name -> weight from a keys file (empty without one: every tenant weighs 1)."""
    return {t.name: t.weight for t in load_tenants(path)} if path else {}


def load_tenants(path: str | pathlib.Path) -> list[Tenant]:
    """Parse a keys file; errors name the file and the entry."""
    path = pathlib.Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"api keys file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"api keys file {path}: not valid YAML: {exc}") from None
    entries = data.get("tenants") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"api keys file {path}: expected a non-empty 'tenants:' list")
    tenants = []
    for i, entry in enumerate(entries):
        where = f"api keys file {path}: tenants[{i}]"
        if not isinstance(entry, dict) or not entry.get("name") or not entry.get("key_sha256"):
            raise ConfigError(f"{where}: needs 'name' and 'key_sha256'")
        digest = str(entry["key_sha256"]).lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ConfigError(f"{where}.key_sha256: expected 64 hex characters (the SHA-256 of the key)")
        unknown = set(entry) - {"name", "key_sha256", "max_request_bytes", "rate_per_second", "burst", "weight"}
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
        rate = entry.get("rate_per_second")
        if rate is not None and float(rate) <= 0:
            raise ConfigError(f"{where}.rate_per_second={rate}: must be > 0 (omit it for no limit)")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1000:
            raise ConfigError(f"{where}.weight={weight!r}: must be a number in (0, 1000] (default 1)")
        tenants.append(
            Tenant(
                name=str(entry["name"]),
                key_sha256=digest,
                max_request_bytes=int(entry["max_request_bytes"]) if entry.get("max_request_bytes") else None,
                rate_per_second=float(rate) if rate is not None else None,
                burst=float(entry["burst"]) if entry.get("burst") else None,
                weight=float(weight),
            )
        )
    if len({t.key_sha256 for t in tenants}) != len(tenants):
        raise ConfigError(f"api keys file {path}: two tenants share a key")
    return tenants


class _TokenBucket:
    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, time.monotonic()
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return True
            return False


def _metadata_key(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.lower().startswith("bearer "):
            return value[7:].strip()
        if key == "x-api-key" and isinstance(value, str):
            return value.strip()
    return None


def _make_interceptor_base() -> type:
    import grpc

    return grpc.aio.ServerInterceptor


class AuthInterceptor(_make_interceptor_base()):  # type: ignore[misc]
    """grpc.aio server interceptor: API key -> tenant, limits, tenant context."""

    def __init__(self, tenants: list[Tenant]) -> None:
        self._by_digest = {t.key_sha256: t for t in tenants}
        self._buckets = {
            t.name: _TokenBucket(t.rate_per_second, t.burst or 2 * t.rate_per_second)
            for t in tenants
            if t.rate_per_second
        }

    def _authenticate(self, metadata: Any) -> Tenant | None:
        key = _metadata_key(metadata)
        if key is None:
            return None
        digest = key_digest(key)
        for known, tenant in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return tenant
        return None

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        import grpc

        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_SERVICES) or handler.unary_unary is None:
            return handler
        tenant = self._authenticate(handler_call_details.invocation_metadata)
        if tenant is None:
            telemetry.record("refusals", 1, tenant="unknown", reason="unauthenticated", method=method)
            return _refusal(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or unknown API key: send metadata 'authorization: Bearer <key>'")
        telemetry.record("tenant_requests", 1, tenant=tenant.name, method=method)
        bucket = self._buckets.get(tenant.name)
        if bucket is not None and not bucket.take():
            telemetry.record("refusals", 1, tenant=tenant.name, reason="rate_limit", method=method)
            pushback_ms = str(max(1, round(1000 / tenant.rate_per_second)))  # one token's refill
            return _refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"rate: tenant {tenant.name!r} is above its limit of {tenant.rate_per_second:g} "
                            "calls/s; retry with backoff", (("grpc-retry-pushback-ms", pushback_ms),))
        inner, decode = handler.unary_unary, handler.request_deserializer
        limit = tenant.max_request_bytes

        def sized_decode(data: bytes) -> Any:
            if limit is not None and len(data) > limit:
                return _Oversize(len(data))  # never parsed
            return decode(data) if decode is not None else data

        async def guarded(request: Any, context: Any) -> Any:
            if isinstance(request, _Oversize):
                telemetry.record("refusals", 1, tenant=tenant.name, reason="request_size", method=method)
                await end_call(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"request: {request.size} bytes, above tenant {tenant.name!r} limit of {limit} bytes")
                return None
            token = _current_tenant.set(tenant.name)
            try:
                return await inner(request, context)
            finally:
                _current_tenant.reset(token)

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=sized_decode, response_serializer=handler.response_serializer,
        )


class _Oversize:
    """Stands in for a request body over the tenant's size limit."""

    def __init__(self, size: int) -> None:
        self.size = size


def _refusal(code: Any, details: str, trailing_metadata: tuple = ()) -> Any:
    """A handler that answers ``code`` without reading the request.

    Declared request-streaming, so grpc.aio runs it before any message is received
    (a unary handler only runs once the whole body has arrived and been parsed);
    the unary caller sees the status as usual.
    """
    import grpc

    async def refuse(request_iterator: Any, context: Any) -> Any:
        await end_call(context, code, details, trailing_metadata)

    return grpc.stream_unary_rpc_method_handler(refuse)


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None) -> Any:
    """TLS server credentials; with ``client_ca_file``, clients must present a certificate it signed."""
    import grpc

    def read(path: str, what: str) -> bytes:
        try:
            return pathlib.Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"serving.{what}: cannot read {path}: {exc.strerror}") from None

    pair = [(read(key_file, "tls_key_file"), read(cert_file, "tls_cert_file"))]
    if client_ca_file:
        return grpc.ssl_server_credentials(
            pair, root_certificates=read(client_ca_file, "tls_client_ca_file"), require_client_auth=True
        )
    return grpc.ssl_server_credentials(pair)

