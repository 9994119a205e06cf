"""``lora-opt bench``: speed and memory of the pipeline, reported as numbers, never as timed tests.

Tooling over the stages, not a stage (nothing in the pipeline imports it): ``stages`` (the twin,
dataset labelling, search trials, the Ray threshold), ``place`` (the placement policies' CPU time and
its growth, 1k-1M adapters), ``fleet`` (fleet twins against independent engines), ``emulate`` (the
emulator's streaming capacity), ``search_backends`` (Optuna and Ray Tune side by side).  The docs'
generated speed tables are written from their ``--out`` JSON by ``experiments/readme_tables.py``.
"""
