"""Surrogates of the twin: the dataset it labels, the features, the trained models and their distillation.

- ``features``: per-GPU features of a set of adapters (the surrogates' inputs).
- ``dataset``: label a grid of single-GPU configurations with the twin (``lora-opt dataset``).
- ``training_data``: a labelled dataset as validated arrays, labels and the held-out split.
- ``training``: train the throughput / starvation heads of each model family, choose them (``lora-opt train``).
- ``metrics``: SMAPE, per-class error rates, the <= 1 % false-feasible threshold, latency.
- ``oracle``: the ``Oracle`` interface the placement policies consult and the full ``Surrogate``.
- ``model_files``: the full surrogate on disk (skops + a checked manifest; never pickle).
- ``distill``: shallow trees from the forests: readable rules and a compiled ``Oracle``.
- ``paper_ng``: the earlier paper's N*/G* model, reported for comparison.
- ``reporting``: plots, ``metrics.json`` and the MLflow run of a training.
"""
