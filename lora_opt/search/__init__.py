"""Search: the trade-off between GPU count and latency.

- ``study``: Optuna multi-objective search over placements, trials replayed on the twin (``lora-opt search``).
- ``tune``: the same study as a Ray Tune experiment (``lora-opt search --backend tune``).
- ``plots``: a study's Pareto-front and hypervolume-history plots (Optuna's own).
- ``bench``: both backends side by side (``lora-opt bench search``).
- ``pareto``: fronts from criteria sweeps of the greedy policies and the search (``lora-opt pareto``).
"""
