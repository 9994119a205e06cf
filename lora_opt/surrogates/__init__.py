"""Surrogates of the twin: the dataset it labels, the features, the trained models and their distillation.

- ``features``: per-GPU features of a set of adapters (the surrogates' inputs).
- ``dataset``: label a grid of single-GPU configurations with the twin (``lora-opt dataset``).
- ``surrogate``: train the throughput / starvation heads; the ``Surrogate`` oracle (``lora-opt train``).
- ``distill``: shallow trees from the forests: readable rules and a compiled predictor.
"""
