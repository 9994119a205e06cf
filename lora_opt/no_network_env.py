"""Importing this module sets environment variables (``NO_NETWORK_ENV``) that keep every component
off the network unless the user points it there: Ray binds to loopback and reports no usage, MLflow
and Optuna send no telemetry.  Values already set by the user win.

Imported first by the CLI, the tests, and every module that imports Ray or MLflow (before they do).
"""
import os

NO_NETWORK_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",   # makes Ray bind to 127.0.0.1
    "RAY_AUTH_MODE": "disabled",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "OPTUNA_DISABLE_TELEMETRY": "1",
}
for _k, _v in NO_NETWORK_ENV.items():
    os.environ.setdefault(_k, _v)
