"""The twin's capacity error on held-apart real H100 runs, the conformal bounds behind ``--confidence``,
their coverage and the Max_pack trade-off (issue 35); one MLflow run (experiment ``error_model``).

    python experiments/error_model.py          # ~2 minutes on 2 cores

Runs ``lora-opt error-model --out experiments/error_model --models-dir configs/error_models``: every
usable end-to-end real run replayed on the twin at its load and at an overload, the bounds fitted on the
report half only (``configs/error_models/<profile>.yaml``, the files ``place`` reads), coverage scored on
runs the bounds never saw, the Max_pack picks at C = 0.5 .. 0.99 cross-fitted per workload.  Rerun it
whenever the twin's numbers move (``tests/test_confidence.py``'s slow test fails until then).
"""
from __future__ import annotations

import sys

from lora_opt.cli import main

if __name__ == "__main__":
    sys.exit(main(["error-model", "--out", "experiments/error_model", "--models-dir", "configs/error_models",
                   *sys.argv[1:]]))
