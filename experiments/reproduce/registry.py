"""The registry of published results, in the order the Results section lists them."""
from __future__ import annotations

from . import (p1_fig1_max_pack, p1_fig2_memory, p1_fig3_compute, p1_fig4_loading, p1_fig5_slora, p1_fig7_twin_curves, p1_fig8_rules, p1_tables12_ng,
                                  p2_fig8_twin_vs_real, p2_fig9_nonstationary, p2_fig10_single_gpu, p2_fig11_azure, p2_table2_twin_cost, p2_table6_place_time,
                                  p2_table1_twin_smape, p2_tables45_surrogates)

RESULTS = [
    p1_fig1_max_pack,
    p1_fig2_memory,
    p1_fig3_compute,
    p1_fig4_loading,
    p1_fig5_slora,
    p1_fig7_twin_curves,
    p1_tables12_ng,
    p1_fig8_rules,
    p2_table1_twin_smape,
    p2_fig8_twin_vs_real,
    p2_fig9_nonstationary,
    p2_table2_twin_cost,
    p2_tables45_surrogates,
    p2_table6_place_time,
    p2_fig10_single_gpu,
    p2_fig11_azure,
]


def by_name(name: str):
    """The result module called ``name``; KeyError naming the known ones otherwise."""
    for m in RESULTS:
        if m.NAME == name:
            return m
    raise KeyError(f"--only: unknown result {name!r}; known: {', '.join(m.NAME for m in RESULTS)}")
