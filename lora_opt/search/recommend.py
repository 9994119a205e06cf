"""``lora-opt place --deployment``: the deployments of :mod:`lora_opt.search.deployments` judged on the fleet
twin at one SLO and one load, the one with the fewest GPUs recommended.

- ``static``: the policy's placement, routed by its weights (what ``place`` answers without the flag);
- ``every-gpu``: N identical instances with every adapter, loaded into a GPU slot on use, the largest
  A_max that starts at the largest rank, the ``lora-affinity`` picker choosing the instance;
- ``hybrid``: the k hottest adapters on every GPU, the tail placed alone by the same policy, plus GPUs
  serving only the hot ones as needed, ``lora-affinity`` choosing a hot adapter's GPU; k searched.

Every candidate is judged the same way (:func:`judge`): the fleet twin replays the workload's evaluation
traffic with every rate at ``load`` x (the confidence's verification load, or 1 + the fixed margin: the
headroom the static placement was verified with) over the workload's evaluation window, clipped to
[``JUDGE_MIN_S``, ``JUDGE_S``] seconds; it meets the SLO when
no GPU starves at rho, none fails to start, every request is routed and, with a bound, the fleet's p99
TTFT is within it.  The recommendation (:func:`rank`): fewest GPUs, then lower p99 TTFT (within ``P99_TIE``: a
tie), then fewer adapter loads."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from lora_opt.placement.evaluate import Criterion, evaluate_on_fleet, served_ok, with_evaluation
from lora_opt.placement.instances import FleetOptions
from lora_opt.placement.plan import Placement
from lora_opt.placement.policies.packing import max_loras_that_start
from lora_opt.placement.workload_file import Workload
from lora_opt.search.deployments import every_gpu_placement, hottest, hybrid_placement, tail_workload
from twin.errors import ScenarioError

#: what ``--deployment`` takes: one deployment, or ``best`` (each judged, the cheapest returned)
DEPLOYMENT_CHOICES = ("static", "every-gpu", "hybrid", "best")
#: hot adapter counts the hybrid tries (those below the workload's adapter count)
HOT_GRID = (1, 2, 5, 10, 20, 50)
#: the longest window a candidate is judged on (simulated seconds): the same for every candidate
JUDGE_S = 600.0
#: the shortest: a workload whose evaluation window is shorter is judged on this many seconds -- the starvation
#: verdict ignores the last GRACE_S (60 s), so a minute-long window would judge nothing
JUDGE_MIN_S = 240.0
#: p99 TTFTs within this fraction of the lower one are a tie (then fewer adapter loads win): the judged p99's
#: seed-to-seed range on the bundled example, 8 seeds at the judged load, was 5.8 % (every-gpu) and 10.5 % (hybrid)
P99_TIE = 0.10
#: the router of the every-gpu and hybrid candidates (the fleet comparison's best: issue 25)
PICKER = "lora-affinity"


@dataclass
class Candidate:
    """One deployment as judged: its placement (None when none could be built in the pool)."""

    deployment: str
    placement: Placement | None
    ok: bool
    gpus: int | None = None
    ttft_p99_ms: float | None = None
    served_fraction: float | None = None
    adapter_loads_per_s: float | None = None
    detail: str = ""
    fleet: FleetOptions | None = None
    """The router and adapter mode it was judged with: what must serve it."""

    def key(self) -> tuple:
        """Fewest GPUs, then lower p99 TTFT, then fewer adapter loads (the strict order; :func:`rank` reads p99s
        within ``P99_TIE`` of each other as equal)."""
        return (not self.ok, self.gpus or 10**9, self._p99(), self.adapter_loads_per_s or 0.0)

    def _p99(self) -> float:
        return self.ttft_p99_ms if self.ttft_p99_ms is not None else float("inf")


def rank(cands: list[Candidate]) -> list[Candidate]:
    """The recommendation's order: met before not met, fewest GPUs, then lower p99 TTFT -- where two p99s are
    within ``P99_TIE`` of the lower one they are a tie, broken by fewer adapter loads (a static placement, which
    loads least, beats a picker-routed one that is only as fast within the twin's own seed spread) -- then
    the strict order."""
    out = sorted(cands, key=Candidate.key)
    if len(out) < 2 or not out[0].ok:
        return out
    group = [c for c in out if c.ok and c.gpus == out[0].gpus]
    low = group[0]._p99()
    tied = [c for c in group if c._p99() <= low * (1 + P99_TIE)]
    first = min(tied, key=lambda c: (c.adapter_loads_per_s or 0.0, c._p99()))
    return [first] + [c for c in out if c is not first]


def judge_window_s(wl: Workload) -> float:
    """The simulated seconds every candidate is judged on: the workload's evaluation window within
    [``JUDGE_MIN_S``, ``JUDGE_S``]."""
    return max(JUDGE_MIN_S, min(wl.evaluation.duration_s, JUDGE_S))


def judge(p: Placement, wl: Workload, fleet: FleetOptions, load: float, ttft_p99_s: float | None) -> dict:
    """The fleet twin's verdict on ``p`` at ``load`` x every rate (module docstring)."""
    scaled = dataclasses.replace(wl, adapters=tuple(dataclasses.replace(a, rate=a.rate * load) for a in wl.adapters))
    scaled = with_evaluation(scaled, duration_s=judge_window_s(wl))
    ev = evaluate_on_fleet(p, scaled, fleet, criterion=Criterion(rho=wl.rho))
    p99 = ev["ttft_ms"]["p99"]
    ok = served_ok(ev) and (ttft_p99_s is None or (p99 is not None and p99 <= ttft_p99_s * 1000))
    return {"ok": bool(ok), "gpus": len(p.gpus), "fleet": fleet, "ttft_p99_ms": p99,
            "served_fraction": ev["served_fraction"],
            "adapter_loads_per_s": (ev["adapter_loads_cpu"] + ev["adapter_loads_disk"]) / ev["duration_s"],
            "detail": (f"{ev['gpus_starving']} GPU(s) starving" if ev["gpus_starving"] else
                       f"{ev['gpus_failing_startup']} GPU(s) fail to start" if ev["gpus_failing_startup"] else
                       f"{ev['unrouted_requests']} request(s) unrouted" if ev["unrouted_requests"] else
                       "" if ok else f"p99 TTFT {p99:,.0f} ms over the bound")}


def _every_gpu(wl, profile, pool, load, ttft_p99_s, most) -> Candidate:
    e = wl.resolved_engine(profile)
    amax = max_loras_that_start(profile, max(a.rank for a in wl.adapters), e.gpu_memory_utilization,
                                e.max_num_batched_tokens, e.max_model_len, e.max_num_seqs, len(wl.adapters))
    if amax < 1:
        return Candidate("every-gpu", None, False, detail="no A_max starts at the largest rank")
    fleet, last = FleetOptions(PICKER, "on-demand"), None
    for n in range(1, min(pool, most) + 1):
        p = every_gpu_placement(wl, profile, n, amax)
        last = Candidate("every-gpu", p, **judge(p, wl, fleet, load, ttft_p99_s))
        last.detail = f"A_max {amax}" + (f"; {last.detail}" if last.detail else "")
        if last.ok:
            return last
    return last or Candidate("every-gpu", None, False, detail="no GPU count to try")


def _hybrid(wl, profile, pool, policy, ctx_for, load, ttft_p99_s, most) -> Candidate:
    best = None
    policy = first_filter(policy)
    fleet = FleetOptions(PICKER, "static")
    for k in (k for k in HOT_GRID if k < len(wl.adapters)):
        hot = hottest(wl, k)
        tail_wl = tail_workload(wl, hot)
        tail = policy.place(tail_wl, pool, ctx_for(tail_wl))
        if not tail.meta.get("feasible", True) or len(tail.gpus) > min(pool, most):
            continue
        for extra in range(0 if tail.gpus else 1, min(pool, most) - len(tail.gpus) + 1):
            p = hybrid_placement(wl, profile, tail, hot, extra)
            c = Candidate("hybrid", p, **judge(p, wl, fleet, load, ttft_p99_s))
            c.detail = f"{k} hot on every GPU, the tail on {len(tail.gpus)}" + (f"; {c.detail}" if c.detail else "")
            if best is None or _better(c, best):
                best = c
            if c.ok:
                most = min(most, len(p.gpus))      # a later k must need fewer GPUs to matter
                break
    return best or Candidate("hybrid", None, False, detail="no hot split fits the pool")


def first_filter(policy):
    """The policy that places a hybrid's tail: ``policy`` without its own twin verification (a copy), since the
    fleet twin judges the whole hybrid anyway -- a tail GPU verified alone, without its hot adapters, says
    nothing about it; the surrogate's packing is the first filter, the judge adds GPUs where it fails."""
    if getattr(policy, "verify_s", 0) > 0:
        policy = copy.copy(policy)
        policy.verify_s = 0.0
    return policy


def _better(c: Candidate, than: Candidate) -> bool:
    """Met beats not met; among met, the recommendation's order; among not met, the one closest to meeting
    it (the most served, then the most GPUs tried): what the table shows as the deployment's best try."""
    if c.ok != than.ok:
        return c.ok
    if c.ok:
        return c.key() < than.key()
    return ((c.served_fraction or 0.0), c.gpus or 0) > ((than.served_fraction or 0.0), than.gpus or 0)


def recommend(wl: Workload, pool: int, static: Placement, *, policy, ctx_for, load: float,
              ttft_p99_s: float | None, deployment: str = "best") -> list[Candidate]:
    """The candidates ``deployment`` names (``best``: all three), judged; sorted best first.  ``static``: the
    policy's placement of ``wl``; ``policy`` places the hybrid's tail, ``ctx_for(workload)`` its context."""
    if deployment not in DEPLOYMENT_CHOICES:
        raise ScenarioError(f"--deployment: {deployment!r} not allowed; allowed values: {', '.join(DEPLOYMENT_CHOICES)}")
    profile = ctx_for(wl).profile
    out = []
    if deployment in ("static", "best"):
        if static.meta.get("feasible", True):
            out.append(Candidate("static", static, **judge(static, wl, FleetOptions("static", "static"), load,
                                                           ttft_p99_s)))
        else:
            out.append(Candidate("static", static, False, len(static.gpus), detail="the policy found no placement"))
    most = min([c.gpus for c in out if c.ok] or [pool])        # a deployment needing more is no better
    if deployment in ("every-gpu", "best"):
        out.append(_every_gpu(wl, profile, pool, load, ttft_p99_s, most))
    most = min([c.gpus for c in out if c.ok] or [pool])
    if deployment in ("hybrid", "best"):
        out.append(_hybrid(wl, profile, pool, policy, ctx_for, load, ttft_p99_s, most))
    return rank(out)


def candidates_table(cands: list[Candidate]) -> str:
    """The judged candidates, one line each, the recommended one first."""
    f = (lambda x, spec: "-" if x is None else format(x, spec))
    lines = [f"{'deployment':<10} {'GPUs':>4} {'meets SLO':>9} {'p99 TTFT ms':>11} {'served':>7} {'loads/s':>7}  note"]
    for c in cands:
        lines.append(f"{c.deployment:<10} {f(c.gpus, '4d'):>4} {'yes' if c.ok else 'no':>9} "
                     f"{f(c.ttft_p99_ms, ',.0f'):>11} {f(c.served_fraction, '.1%'):>7} "
                     f"{f(c.adapter_loads_per_s, '.1f'):>7}  {c.detail}")
    return "\n".join(lines)
