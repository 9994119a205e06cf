"""``lora-opt probe``: measuring a live server for a profile (the families and plans: ``plan``; what
each measurement isolates: ``measure``; ``vllm serve`` re-flagged per family, started, health-checked
and stopped: ``launch``; orchestration, the rows CSV and the MLflow run: ``run``; a fitted profile
against a known one: ``compare``).  Rows are fitted by ``lora-opt calibrate``
(:mod:`lora_opt.calibration.probe_fit`).  A stage after ``validate``: it sends with the emulator's
client and reads ``/metrics`` and ``/version`` as ``validate`` does."""
