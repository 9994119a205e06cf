"""Re-placement: a running fleet moved to a new demand with few moves, and the day it serves.

- ``replan``: the new placement from the current one (moves, kept instances, the transition's bound).
- ``replan_steps``: the ordered steps that carry a replan out (runtime LoRA loads and unloads, launches,
  router-table changes, drains, stops) -- what ``lora_opt.apply`` executes.
- ``drift``: the drift generator, one workload per step of a day from a seeded drift YAML.
- ``schedule``: a day of workloads re-placed step by step against placing from scratch (``lora-opt schedule``).
- ``router_config``: the router's configurations for a placement (gateway manifests, ``vllm-router``
  command) and the health-check settings (``HealthChecks``) the emulated router shares.
- ``run``: ``lora-opt replan`` and ``lora-opt schedule`` as one call each (``replan_running``,
  ``schedule_horizon``; ``ReplanOptions``, the settings they and ``operate`` share): inputs read, files
  written, the text they print.

A stage after ``placement`` (it moves placements; ``placement`` never imports it) and before
``emulate`` (whose router takes ``HealthChecks`` from here).
"""
