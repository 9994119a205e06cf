"""Real runs replayed on the twin: which runs qualify, and their twin results.

Shared by ``fidelity`` (the report) and ``e2e_fit`` (the fit half's search).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from lora_opt.calibration import realruns
from lora_opt.io import atomic_write_text
from lora_opt.parallel import run_scenarios


def select_runs(runs, family: str | None = None):
    """Usable validation runs, optionally only those whose experiment contains ``family``."""
    rows = runs[runs["experiment"].astype(str).str.startswith(realruns.REPLAYED_FAMILIES)]
    if family:
        rows = rows[rows["experiment"].str.contains(family, regex=False)]
    keep = [realruns.usable(r)[0] for _, r in rows.iterrows()]
    return rows[np.array(keep, bool)] if len(rows) else rows


def simulate_runs(rows, lengths: str, workers: int | None, ray_address: str | None):
    """Twin results of ``rows`` with their bundled profiles (``lengths``: auto | mean)."""
    scenarios = [realruns.run_to_scenario(r, lengths=lengths) for _, r in rows.iterrows()]
    return run_scenarios(scenarios, workers=workers, ray_address=ray_address,
                         desc=f"fidelity ({lengths} lengths)")


def replay_with_profile(rows, profile: dict, tmp: Path, workers: int | None) -> list[dict]:
    """Twin results of ``rows`` with ``profile`` (a dict, written to ``tmp``) instead of the bundled one."""
    path = tmp / f"profile_{abs(hash(yaml.safe_dump(profile)))}.yaml"
    atomic_write_text(path, yaml.safe_dump(profile))
    scenarios = []
    for _, r in rows.iterrows():
        s = realruns.run_to_scenario(r)
        s["profile"] = str(path)
        scenarios.append(s)
    return run_scenarios(scenarios, workers=workers, progress=False)
