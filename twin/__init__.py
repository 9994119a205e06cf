"""lora-opt's digital twin of one vLLM engine serving many LoRA adapters.

    import twin
    result = twin.simulate(twin.load_scenario("configs/scenarios/example.yaml"))
"""
from twin.errors import ScenarioError
from twin.profile import Profile, load_profile
from twin.scenario import Scenario, load_scenario, scenario_from_dict
from twin.simulate import Result, simulate

__version__ = "0.1.0"
__all__ = ["Profile", "Result", "Scenario", "ScenarioError", "load_profile", "load_scenario",
           "scenario_from_dict", "simulate", "__version__"]
