"""The router's view of which instances are alive: an instance is *ejected* (sent nothing) when a
connection to it is refused or fails its health checks, and *re-admitted* when it passes them again.

Two signals, as gateways have them (vllm-router's health checks and circuit breaker, Envoy's active
health checking and outlier detection):

* passive -- a request's connection is refused or not accepted in time: the request never reached
  the instance, so the router ejects the instance at once and sends the request to another instance
  that serves its adapter (:mod:`lora_opt.emulate.router`);
* active -- every ``interval_s`` the router asks each instance's ``/health`` (vLLM answers 200 while its
  engine lives): ``failure_threshold`` failed checks in a row (a non-200, no answer within
  ``timeout_s``) eject it, a refused connection ejects it at once; ``success_threshold`` passed checks
  in a row re-admit an ejected one.

The settings (:class:`HealthChecks`) live with the router configurations ``place --emit-router`` writes,
which set the same values in vllm-router's flags and the pods' readiness probes.  A request that was sent
is never retried (the instance may have run it); a retired instance (a drain)
is not checked and never re-admitted by a check: only a new route to it brings it back."""
from __future__ import annotations

import asyncio
import logging
import time

from lora_opt.emulate.request_validation import APIError
from lora_opt.replan.router_config import RETRY_BACKOFF_S, HealthChecks

log = logging.getLogger(__name__)


class EndpointHealth:
    """Per instance (engine index): ejected or not, why and since when, and the run of checks that
    decides the next change.  Pure bookkeeping: the checks' results come from :func:`check_forever`
    and the router's failed connections."""

    def __init__(self, n: int, checks: HealthChecks):
        self.checks = checks
        self.ejected: dict[int, tuple[str, float]] = {}
        """Engine -> (why, when: time.time()) for every instance sent nothing until re-admitted."""
        self.failed = [0] * n            # failed checks in a row
        self.passed = [0] * n            # passed checks in a row (counts while ejected)
        self.events: list[dict] = []
        """Every ejection and re-admission, in order: {"engine", "event", "reason", "at"}."""
        self.rounds = 0
        """Rounds of active checks done (``GET /router/routes``' ``health_rounds``: the checks are alive)."""
        self.checking = False
        """Whether the active checks run now (the router's lifespan sets it): without them nothing is
        ejected, as nothing could re-admit it."""

    def grow(self, n: int) -> None:
        """Instances joined the fleet (a route to a new endpoint): healthy until a check says otherwise."""
        self.failed += [0] * (n - len(self.failed))
        self.passed += [0] * (n - len(self.passed))

    def eject(self, engine: int, reason: str) -> bool:
        """Send ``engine`` nothing more until it passes its checks; False when no active checks run
        (nothing could re-admit it) or it is ejected already."""
        if not self.checking or engine in self.ejected:
            return False
        self.ejected[engine] = (reason, time.time())
        self.passed[engine] = 0
        self.events.append({"engine": engine, "event": "ejected", "reason": reason, "at": time.time()})
        return True

    def record(self, engine: int, ok: bool, reason: str = "", refused: bool = False) -> str | None:
        """One active check's result; returns "ejected" / "readmitted" when it changed the state."""
        if ok:
            self.failed[engine] = 0
            self.passed[engine] += 1
            if engine in self.ejected and self.passed[engine] >= self.checks.success_threshold:
                del self.ejected[engine]
                self.events.append({"engine": engine, "event": "readmitted", "reason": "health checks passed",
                                    "at": time.time()})
                return "readmitted"
            return None
        self.passed[engine] = 0
        self.failed[engine] += 1
        if refused or self.failed[engine] >= self.checks.failure_threshold:
            return "ejected" if self.eject(engine, reason) else None
        return None

    def state(self, engine: int, retired: bool) -> dict:
        """``GET /router/routes``' entry: state (healthy / ejected / retired), why, for how long."""
        if retired:
            return {"state": "retired", "reason": "drained (POST /router/retire)", "for_s": None}
        if engine in self.ejected:
            reason, since = self.ejected[engine]
            return {"state": "ejected", "reason": reason, "for_s": round(time.time() - since, 3),
                    "checks_passed": self.passed[engine]}
        return {"state": "healthy", "reason": None, "for_s": None, "checks_failed": self.failed[engine]}


def health_url(endpoint: str, path: str) -> str:
    """The check's URL: the instance's root (``endpoint`` without its ``/v1``) + ``path``."""
    root = endpoint[: -len("/v1")] if endpoint.endswith("/v1") else endpoint
    return root + path


async def check_once(client, url: str, timeout_s: float) -> tuple[bool, str, bool]:
    """(ok, why not, refused) of one ``GET url``."""
    import httpx  # only where a router runs
    try:
        r = await client.get(url, timeout=timeout_s)
    except httpx.ConnectError as exc:
        return False, f"health check: connection refused ({exc or 'ConnectError'})", True
    except httpx.TimeoutException:
        return False, f"health check: no answer within {timeout_s:g} s", False
    except Exception as exc:            # noqa: BLE001 - whatever went wrong, the instance did not pass
        return False, f"health check: {type(exc).__name__}: {exc or 'connection lost'}", False
    if r.status_code != 200:
        return False, f"health check: HTTP {r.status_code}", False
    return True, "", False


async def check_forever(table, client) -> None:
    """Check every instance of ``table`` (a :class:`~lora_opt.emulate.router.RouteTable`) that is not
    retired, all at once, every ``interval_s``, until cancelled."""
    health = table.health
    checks = health.checks
    health.checking = True
    try:
        await _check_rounds(table, client)
    finally:
        health.checking = False
        for e in list(health.ejected):          # nothing re-admits them any more: sent to again
            del health.ejected[e]


async def _check_rounds(table, client) -> None:
    health = table.health
    checks = health.checks
    while True:
        engines = [e for e in range(len(table.endpoints)) if e not in table.retired]
        try:
            results = await asyncio.gather(*(check_once(client, health_url(table.endpoints[e], checks.endpoint),
                                                        checks.timeout_s) for e in engines))
            for e, (ok, why, refused) in zip(engines, results):
                if e < len(health.failed):
                    health.record(e, ok, why, refused)
        except Exception:               # noqa: BLE001 - the checks must outlive any one round (a dead loop
            log.exception("router health checks: a round failed")    # would leave every instance "healthy")
        health.rounds += 1
        await asyncio.sleep(checks.interval_s)


async def next_engine(table, request, model: str | None, tried: list, give_up: float) -> int:
    """The instance for a request's next try among those not ``tried``; when none is left (each refused it:
    it was never sent) the whole choice again every :data:`RETRY_BACKOFF_S` until ``give_up`` (monotonic
    seconds; an instance launched again meanwhile serves it), then ``table.pick_engine``'s error (a 499 when
    the client went away while its request waited)."""
    while True:
        try:
            return table.pick_engine(model, exclude=tried)
        except APIError:
            if time.monotonic() + RETRY_BACKOFF_S > give_up:
                raise
        await asyncio.sleep(RETRY_BACKOFF_S)
        if await request.is_disconnected():
            raise APIError(499, "the client went away while its request waited for an instance", "ClientClosed")
        tried.clear()
