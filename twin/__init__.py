"""lora-opt's digital twin of one vLLM engine serving many LoRA adapters.

    import twin
    result = twin.simulate(twin.load_scenario("example"))   # a bundled scenario, or a path to a YAML
"""
from importlib import metadata as _metadata

from twin.errors import ScenarioError
from twin.profile import Profile, load_profile
from twin.scenario import Scenario, load_scenario, scenario_from_dict
from twin.simulate import Result, simulate

try:
    __version__ = _metadata.version("lora-opt")
except _metadata.PackageNotFoundError:   # imported from a checkout that was never pip-installed
    __version__ = "0+unknown"
__all__ = ["Profile", "Result", "Scenario", "ScenarioError", "load_profile", "load_scenario",
           "scenario_from_dict", "simulate", "__version__"]
