"""HTTP clients that talk to vLLM instances: one keep-alive rule for every pooled client (:func:`instance_client`).

vLLM's API server (uvicorn; ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``) closes a connection idle for 5 s.  A pool
that keeps idle connections as long (httpx's default, 5 s) can send a request on a connection at the
instant the server closes it: the request fails (``ReadError``) though the server is healthy.  Measured
on the emulated fleet: requests sent 4.985-5.0 s after the connection's last use failed 2 of 31 and 1
of 31; with the pool letting connections go at 2 s, 0 of 31 and 0 of 21 (tests/test_emulate_fleet.py).
"""
from __future__ import annotations

#: seconds an idle pooled connection to an instance is kept: well below the 5 s after which vLLM's server
#: closes an idle connection, so no request is sent on a connection the instance is closing
KEEPALIVE_EXPIRY_S = 2.0


def instance_limits(max_connections: int | None = 100, max_keepalive_connections: int = 20):
    """httpx pool limits for connections to vLLM instances: httpx's default sizes (100 connections, 20 kept
    idle) unless given, the keep-alive below the server's (:data:`KEEPALIVE_EXPIRY_S`)."""
    import httpx  # only where instances are talked to: keeps the CLI's start-up light

    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_keepalive_connections,
                        keepalive_expiry=KEEPALIVE_EXPIRY_S)


def instance_client(*, timeout=5.0, max_connections: int | None = 100, max_keepalive_connections: int = 20):
    """An ``httpx.AsyncClient`` for vLLM instances: :func:`instance_limits`' pool, never a proxy from the
    environment (``trust_env=False``), ``timeout`` httpx's default unless given."""
    import httpx  # only where instances are talked to: keeps the CLI's start-up light

    return httpx.AsyncClient(timeout=timeout, trust_env=False,
                             limits=instance_limits(max_connections, max_keepalive_connections))
