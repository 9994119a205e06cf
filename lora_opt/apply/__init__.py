"""Applying a replan to a running fleet: its steps carried out on live endpoints (vLLM's runtime
LoRA endpoints, the router's table, launches, drains, stops) while traffic flows, and the
transition measured (failed requests, TTFT before, during and after)."""
