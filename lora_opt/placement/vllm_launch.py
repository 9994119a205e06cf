"""``vllm serve`` commands and a router table for a placement (vLLM 0.33's real flags).

Every command pins what would otherwise drift with hardware or version defaults: LoRA flags,
``--max-model-len``, ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--gpu-memory-utilization``,
``--block-size 16``, FCFS scheduling, prefix caching and async scheduling off (as the twin models).  ``validate_serve_args`` checks a command against the
option table of vLLM 0.33.0's own parser (``data/reference/vllm_serve_args-0.33.0.json``) without
installing vLLM; where the ``[vllm]`` extra is installed, the tests also run vLLM's parser itself.
"""
from __future__ import annotations

import functools
import json
import re

from lora_opt.placement.plan import Placement
from twin.errors import ScenarioError
from twin.parsing import check_adapter_id, check_adapter_path
from twin.paths import VLLM_SERVE_ARGS as SERVE_ARGS


@functools.lru_cache(maxsize=1)
def serve_options() -> dict:
    return json.loads(SERVE_ARGS.read_text())["options"]


def serve_command(p: Placement, gpu: int, model: str, *, host: str = "127.0.0.1", port: int = 8000,
                  adapters=None) -> list[str]:
    """argv of ``vllm serve`` for GPU ``gpu`` of the placement (``adapters``: its adapters, when
    the caller already has them)."""
    g = p.gpus[gpu]
    adapters = p.adapters_on(gpu) if adapters is None else adapters
    if not model or model.startswith("-") or any(not c.isprintable() for c in model):
        raise ScenarioError(f"model: {model!r:.80} cannot be a vllm serve argument (empty, a leading '-' or "
                            "control characters)")
    for a in adapters:                   # the launch rule, also for placements built in code
        check_adapter_id(a.id, f"adapter {a.id!r:.40}")
        if a.path is not None:
            check_adapter_path(a.path, f"adapter {a.id}.path")
    modules = [f"{a.id}={a.path or f'adapters/{a.id}'}" for a in adapters]
    argv = ["vllm", "serve", model, "--host", host, "--port", str(port),
            "--enable-lora", "--max-loras", str(g.max_loras), "--max-lora-rank", str(g.max_lora_rank),
            "--max-cpu-loras", str(g.max_cpu_loras), "--max-model-len", str(g.max_model_len),
            "--max-num-seqs", str(g.max_num_seqs), "--max-num-batched-tokens", str(g.max_num_batched_tokens),
            "--gpu-memory-utilization", str(g.gpu_memory_utilization), "--block-size", "16",
            "--scheduling-policy", "fcfs",
            # the twin models neither prefix caching nor async scheduling: pin both off
            "--disable-prefix-caching", "--no-async-scheduling"]
    if modules:
        argv += ["--lora-modules", *modules]
    return argv


def router_table(p: Placement, *, host: str = "127.0.0.1", base_port: int = 8000) -> dict:
    """adapter id -> [{"endpoint", "weight"}] (GPU i listens on base_port + i)."""
    return {aid: [{"endpoint": f"http://{host}:{base_port + g}/v1", "weight": w} for g, w in rs]
            for aid, rs in p.routes.items()}


#: argparse's rule (``_negative_number_matcher``): with no option that looks like a negative number,
#: as in vLLM's parser, such an argument is a value; any other argument starting with '-' is an option
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _is_option(arg: str) -> bool:
    return arg.startswith("-") and arg != "-" and not _NEGATIVE_NUMBER.match(arg)


def lora_module_problems(value: str) -> list[str]:
    """Why vLLM 0.33 would not read ``value`` of ``--lora-modules`` as the ``name=path`` lora-opt
    meant: its ``LoRAParserAction`` takes a value holding '=' and no ',' as ``name=path``, split on
    '=' (a second '=' is an error), and anything else as JSON."""
    if "=" not in value or "," in value:
        return [f"--lora-modules {value!r:.80}: not name=path ({'a' if ',' in value else 'no'} ',' "
                f"{'and' if ',' in value else 'or no'} '='): vLLM would read it as JSON"]
    name, _, path = value.partition("=")
    problems = []
    if "=" in path:
        problems.append(f"--lora-modules {value!r:.80}: more than one '=' (vLLM splits name=path on '=')")
    if not name or not path:
        problems.append(f"--lora-modules {value!r:.80}: empty name or path")
    return problems


def validate_serve_args(argv: list[str]) -> list[str]:
    """Problems with a ``vllm serve`` argv against vLLM 0.33.0's option table (empty = valid): every
    option is in the table, flags take no value, values have the option's type and choices, and
    each ``--lora-modules`` value reads as the intended ``name=path``."""
    opts = serve_options()
    if argv[:2] != ["vllm", "serve"] or len(argv) < 3 or _is_option(argv[2]):
        return ["expected: vllm serve MODEL [options]"]
    problems, i = [], 3
    while i < len(argv):
        name = argv[i]
        spec = opts.get(name)
        if spec is None:
            problems.append(f"unknown option {name}" if _is_option(name) else f"stray value {name!r:.80}")
            i += 1
            continue
        values = []
        i += 1
        while i < len(argv) and not _is_option(argv[i]):
            values.append(argv[i])
            i += 1
        if spec["flag"]:
            if values:
                problems.append(f"{name} takes no value, got {values}")
            continue
        if spec["nargs"] == "+":
            if not values:
                problems.append(f"{name} needs at least one value")
            if name == "--lora-modules":
                problems += [q for v in values for q in lora_module_problems(v)]
            continue
        if len(values) != 1:
            problems.append(f"{name} takes one value, got {values}")
            continue
        v = values[0]
        if spec["choices"] is not None and v not in spec["choices"]:
            problems.append(f"{name} {v}: not one of {spec['choices']}")
        if spec["type"] in ("int", "human_readable_int"):
            try:
                int(v)
            except ValueError:
                problems.append(f"{name} {v}: not an integer")
        if spec["type"] == "float":
            try:
                float(v)
            except ValueError:
                problems.append(f"{name} {v}: not a number")
    return problems


def check_serve_args(argv: list[str]) -> None:
    problems = validate_serve_args(argv)
    if problems:
        raise ScenarioError("invalid vllm serve command: " + "; ".join(problems))
