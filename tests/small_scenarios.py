"""A small scenario for tests (imported as ``from small_scenarios import small_scenario``: a module of
its own, because ``conftest`` names two modules -- tests/conftest.py and tests/real_vllm/conftest.py --
and ``from conftest import`` gets whichever pytest imported last)."""

PROFILE = "llama-3.1-8b-h100-64gb"


def small_scenario(**over):
    """A scenario small enough for per-step invariant checks."""
    sc = {
        "profile": PROFILE,
        "engine": {"max_loras": 4, "max_lora_rank": 16, "max_num_seqs": 64, "max_num_batched_tokens": 512},
        "adapters": [{"count": 6, "rank": 8, "rate": 0.5}, {"count": 4, "rank": 16, "rate": 1.0}],
        "duration_s": 60,
        "seed": 1,
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(sc.get(k), dict):
            sc[k] = {**sc[k], **v}
        else:
            sc[k] = v
    return sc
