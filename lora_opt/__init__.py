"""lora-opt: place many LoRA adapters on vLLM GPUs with a calibrated digital twin of the engine."""
from importlib import metadata as _metadata

try:
    #: the installed distribution's version (``lora-opt --version``)
    __version__ = _metadata.version("lora-opt")
except _metadata.PackageNotFoundError:   # imported from a checkout that was never pip-installed
    __version__ = "0+unknown"
