"""``lora-opt bench twin``'s per-scenario child: its memory is its own, and a starving scenario's
early-stop time is measured beside the full run in the same process."""
import numpy as np

from lora_opt.bench.stages import BASE, _run
from twin.scenario import scenario_dict


def _rss_mb() -> float:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024


def test_the_child_reports_its_own_peak_rss_not_its_parents_and_times_early_stop_in_the_same_process():
    ballast = np.ones(400 * 2**20 // 8)      # the parent holds 400 MB more than the child will
    parent = _rss_mb()
    sc = scenario_dict(BASE["profile"], [{"count": 16, "rank": 16, "rate": 4.0}],
                       engine=dict(BASE["engine"], max_loras=8), duration_s=120, seed=0)
    r = _run(sc, 1)
    assert r["peak_rss_mb"] < parent - 200, (r["peak_rss_mb"], parent)   # ru_maxrss would report >= parent
    assert 0 < r["base_rss_mb"] <= r["peak_rss_mb"]
    assert r["starving"] and r["early"]["stopped_early_s"] is not None
    assert 0 < r["early"]["cpu_s"] and r["stopped_early_s"] is None       # the full run ran to the end
    del ballast
