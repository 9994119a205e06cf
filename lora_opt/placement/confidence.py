"""A placement's GPUs judged at a stated confidence: one number per GPU a user can read.

For each GPU the twin measures its **capacity** (the GPU's own adapters and flags, replayed at 2x its
load, or 4x / 8x while the twin still serves it all); the profile's error model
(``lora_opt.calibration.error_model``) turns it into

- the **margin at C**: the real capacity's lower bound at confidence C over the GPU's expected load,
  minus 1 (+20 % = at least 20 % headroom with probability C; the GPU starves below rho - 1);
- **P(starve)**: the estimated probability that the real server's capacity is below rho x the load.

``resolve_bound`` is the one place a confidence becomes a verification load: greedy-plus verifies
each GPU on the twin at ``1 / bound`` x its load (``GreedyPlus(confidence=...)``), and ``place`` /
``evaluate`` print the margin and P(starve) computed here.
"""
from __future__ import annotations

from dataclasses import dataclass

import twin
from lora_opt.calibration.error_model import (DEFAULT_CONFIDENCE, TWIN_SATURATED, Bound, ErrorModel,
                                              bundled_error_model, check_confidence, error_model_path, load_error_model)
from lora_opt.errors import InputError
from lora_opt.placement.instances import gpu_scenario
from lora_opt.placement.plan import Placement
from lora_opt.placement.workload_file import Workload
from lora_opt.tracking import profile_info
from twin.paths import bundle_relative
from twin.scenario import scenario_from_dict

#: load factors of the capacity replay, in order, until the twin serves less than TWIN_SATURATED
CAPACITY_LOADS = (2.0, 4.0, 8.0)
#: seconds of traffic in a capacity replay (a rate: the queue only grows at overload)
CAPACITY_S = 600.0


@dataclass(frozen=True)
class ConfidenceSetting:
    """The confidence decisions are made at, and the error model behind it (None: the fixed margin)."""

    model: ErrorModel | None
    bound: Bound | None
    confidence: float | None

    def to_dict(self) -> dict | None:
        if self.bound is None:
            return None
        b = self.bound
        return {"confidence": b.confidence, "capacity_ratio_bound": b.ratio, "samples": b.samples, "n": b.n,
                "verification_load": b.verification_load, "error_model": self.model.path if self.model else None}


def resolve_bound(profile, confidence: float | None, error_model: str | None = None, *,
                  margin_given: bool = False) -> ConfidenceSetting:
    """The bound at ``confidence`` for ``profile`` (a loaded ``Profile``): from ``error_model`` (a file)
    or the profile's bundled one -- which applies only to the profile file it was fitted for (its
    sha256, recorded at fit time: a recalibrated profile is another twin, whose error was never measured).

    ``confidence`` None means the default: DEFAULT_CONFIDENCE where the profile has an error model,
    else no confidence (the fixed margin); an explicit confidence without an error model, or beside an
    explicit ``--margin``, is refused (InputError naming the flags and file)."""
    explicit = confidence is not None
    if explicit:
        confidence = check_confidence(confidence)
        if margin_given:
            raise InputError("--confidence and --margin: give one -- the confidence derives the verification load "
                             "from the twin's measured error, --margin sets it by hand")
    elif margin_given:
        return ConfidenceSetting(None, None, None)
    why = ""
    if error_model:
        model = load_error_model(error_model)
    else:
        model = bundled_error_model(profile.name)
        info = profile_info(profile)
        fitted_for = model.meta.get("profile_sha256") if model else None
        if model is not None and fitted_for and info and info[1] != fitted_for:
            why = (f"{model.path} was fitted for the profile file with sha256 {fitted_for}; {profile.source} has "
                   f"{info[1]} (recalibrated?)")
            model = None
        elif model is None:
            why = f"{bundle_relative(error_model_path(profile.name))} does not exist"
    if model is None:
        if explicit:
            raise InputError(f"--confidence {confidence:g}: profile {profile.name!r} has no error model ({why}); fit "
                             "one on held-apart real runs (lora-opt error-model) and pass --error-model FILE, or leave "
                             "--confidence out (the fixed --margin applies)")
        return ConfidenceSetting(None, None, None)
    c = confidence if explicit else DEFAULT_CONFIDENCE
    return ConfidenceSetting(model, model.bound(c), c)


def twin_capacity(p: Placement, wl: Workload, g: int, on: list) -> tuple[float, float, bool]:
    """(capacity tok/s, expected load tok/s, capacity exact?) of GPU ``g`` on the twin: its throughput at
    the first load factor of CAPACITY_LOADS that saturates it (exact = False: even the last did not,
    so the capacity is at least the value)."""
    for f in CAPACITY_LOADS:
        sc, _ = gpu_scenario(p, wl, g, on, CAPACITY_S)
        for a in sc["adapters"]:
            a["rate"] = a["rate"] * f
        sc["early_stop"] = False
        res = twin.simulate(scenario_from_dict(sc, f"gpu {g} capacity"))
        if res.status != "ok":
            return 0.0, 0.0, True
        load = res.incoming_token_rate / f
        if res.throughput_tok_s < TWIN_SATURATED * res.incoming_token_rate:
            return res.throughput_tok_s, load, True
    return res.throughput_tok_s, load, False


def annotate(p: Placement, wl: Workload, setting: ConfidenceSetting) -> None:
    """Adds the per-GPU capacity, margin at C and P(starve) to ``p.meta`` (nothing without a bound)."""
    if setting.bound is None or not p.gpus:
        return
    b, model = setting.bound, setting.model
    caps, margins, risks, exact = [], [], [], []
    failing = set(p.meta.get("gpus_failing_startup", []))
    for g, on in enumerate(p.by_gpu()):
        if g in failing or not on:
            caps.append(None), margins.append(None), risks.append(None), exact.append(True)
            continue
        cap, load, ok = twin_capacity(p, wl, g, on)
        caps.append(cap)
        exact.append(ok)
        margins.append(b.ratio * cap / load - 1.0 if load > 0 else None)
        risks.append(model.p_starve(cap, load, wl.rho, key=b.samples))
    p.meta.update({"confidence": setting.to_dict(), "twin_capacity_tok_s": caps, "twin_capacity_exact": exact,
                   "margin_at_confidence": margins, "p_starve": risks})


def at_confidence(p: Placement, rho: float) -> dict:
    """The per-GPU judgement ``annotate`` added, as an evaluation reports it: the GPUs whose margin at C
    is below rho - 1 (their real capacity's lower bound is below rho x their load)."""
    m = p.meta
    margins = m.get("margin_at_confidence") or []
    return {"confidence": m.get("confidence"), "margin_at_confidence": margins, "p_starve": m.get("p_starve"),
            "twin_capacity_tok_s": m.get("twin_capacity_tok_s"),
            "gpus_below": [g for g, x in enumerate(margins) if x is not None and x < rho - 1.0 - 1e-12]}
