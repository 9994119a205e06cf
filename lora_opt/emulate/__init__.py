"""``lora-opt emulate``: vLLM's OpenAI-compatible multi-LoRA API served from the twin in real time
(docs/emulate.md).  ``engine`` drives ``twin.engine.step``; ``server`` is one instance's HTTP
surface, ``metrics`` its Prometheus metrics; ``fleet`` builds and serves instances (one, or one
per GPU of a placement) and ``router`` fronts a fleet; ``client`` and ``bench`` measure it."""
