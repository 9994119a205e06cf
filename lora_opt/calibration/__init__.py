"""Calibration and fidelity: fit a twin profile on real vLLM runs and measure the twin against them.

- ``model_table``: the (model, GPU, vLLM version) setups, from ``configs/models.yaml``.
- ``runs_csv``: the real-runs CSV (the one validating loader, a family's rows) every other module reads.
- ``realruns``: real runs as twin scenarios.
- ``profile_fit``: the estimator families -> a profile YAML (``lora-opt calibrate``), from
  ``fitting`` (shared fit primitives), ``memory_fit``, ``max_num_seqs_fit``, ``step_fit``, ``loading_fit`` and
  ``memory_check``; ``generations`` says which fits each engine generation runs (a generation's fits carry
  its key as a suffix: ``fit_decode_v1``, ``fit_loading_v0``).
- ``e2e_fit``: the constants only end-to-end runs identify, on the fit half (``lora-opt calibrate-e2e``);
  ``e2e_params`` sets them in a profile dict.
- ``replay``: real runs replayed on the twin (shared by ``e2e_fit`` and ``fidelity``).
- ``fidelity``: replay real runs on the twin, SMAPE per metric, beside the published twin.
- ``report``: the fit report (markdown + residual plots).
"""
