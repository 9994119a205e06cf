"""Search: the trade-off between GPU count and latency.

- ``study``: Optuna multi-objective search over placements, trials replayed on the twin (``lora-opt search``).
- ``pareto``: fronts from criteria sweeps of the greedy policies and the search (``lora-opt pareto``).
"""
