"""``lora-opt validate``: a placement's traffic replayed against live OpenAI-compatible endpoints
(vLLM, or ``lora-opt emulate``), measured as ``vllm bench serve`` measures, compared with the
twin's prediction on the same requests (``live``: sending and scraping; ``measure``: per-request
metrics and the evaluate schema of the measured run; ``report``: outputs, plots, MLflow; ``run``: the
command as one call, ``validate(ValidateOptions(...))``)."""
