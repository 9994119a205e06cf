"""Placement: workload files, the placement and its checker, the policies, evaluation on the twin, launch.

- ``workload_file``: adapters, shared engine flags and evaluation settings from a workload YAML.
- ``plan``: ``Placement`` (adapters per GPU, routes, each instance's flags) and its independent checker.
- ``policies``: the placement policies behind one interface (``PlacementPolicy``, ``POLICIES``); ``packing``
  holds the priority order and A_max memory cap the packing policies and the search share.
- ``evaluate``: replay a placement's traffic on the twin, one simulation per GPU.
- ``trace_split``: the papers' distributed setting from a request trace (rates from one half, replay the other).
- ``vllm_launch``: ``vllm serve`` commands and a router table for a placement.
- ``report``: a placement as ``lora-opt place`` reports it: table, verdict (exit status), files.
"""
