"""Every pooled HTTP client that talks to vLLM instances lets idle connections go before the server does.

vLLM's server closes a connection idle for 5 s; httpx's default pool keeps one 5 s, so a request can be
sent on a connection at the instant the server closes it (measured: tests/test_emulate_fleet.py's
keep-alive test).  The rule has one owner, lora_opt.http_pool; this test finds the clients that bypass it."""
from __future__ import annotations

import ast
from pathlib import Path

from lora_opt.http_pool import KEEPALIVE_EXPIRY_S, instance_client, instance_limits

ROOT = Path(__file__).resolve().parent.parent
#: modules whose httpx clients talk to instances repeatedly (a pool that outlives one request)
INSTANCE_CLIENTS = ("lora_opt/apply", "lora_opt/emulate/router.py")
#: vLLM's API server: VLLM_HTTP_TIMEOUT_KEEP_ALIVE (seconds an idle connection is kept)
VLLM_SERVER_KEEPALIVE_S = 5.0


def _client_calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("AsyncClient", "Client")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "httpx"):
            yield node


def test_the_pool_lets_idle_connections_go_before_the_server_does():
    limits = instance_limits()
    assert limits.keepalive_expiry == KEEPALIVE_EXPIRY_S
    assert KEEPALIVE_EXPIRY_S <= VLLM_SERVER_KEEPALIVE_S - 2.0     # margin for a busy event loop


def test_every_instance_client_uses_the_pool_rule():
    files = []
    for entry in INSTANCE_CLIENTS:
        p = ROOT / entry
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    made, bypass = 0, []
    for path in files:
        tree = ast.parse(path.read_text())
        made += sum(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "instance_client"
                    for n in ast.walk(tree))
        bypass += [f"{path.relative_to(ROOT)}:{call.lineno}" for call in _client_calls(path)]
    assert made >= 5, "the scan found too few clients: did the modules move?"
    assert not bypass, f"httpx clients to instances not made by lora_opt.http_pool.instance_client(): {bypass}"


def test_the_instance_client_keeps_the_pool_rule_and_no_proxy():
    import asyncio

    async def make():
        async with instance_client() as client:
            pool = client._transport._pool          # httpx keeps the limits on its connection pool
            return pool._keepalive_expiry, client._trust_env
    assert asyncio.run(make()) == (KEEPALIVE_EXPIRY_S, False)
