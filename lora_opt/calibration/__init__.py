"""Calibration and fidelity: fit a twin profile on real vLLM runs and measure the twin against them.

- ``realruns``: the real-runs CSV as twin scenarios (the rows every other module reads).
- ``profile_fit``: the estimator families -> a profile YAML (``lora-opt calibrate``).
- ``e2e_fit``: the constants only end-to-end runs identify, on the fit half (``lora-opt calibrate-e2e``).
- ``fidelity``: replay real runs on the twin, SMAPE per metric, beside the published twin.
- ``report``: the fit report (markdown + residual plots).
"""
