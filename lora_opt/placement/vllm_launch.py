"""``vllm serve`` commands and a router table for a placement, in the flags of a chosen vLLM release.

Every command pins what would otherwise drift with hardware or version defaults: LoRA flags,
``--max-model-len``, ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--gpu-memory-utilization``,
``--block-size`` of the profile (16 on GPUs), FCFS scheduling, prefix caching and async scheduling off (as the twin models).

Flags differ between releases (vLLM 0.32 spells prefix caching off ``--no-enable-prefix-caching``;
0.33's parser lists ``--disable-prefix-caching``), so every command is written for one release and
checked against the option table recorded from that release's own parser
(``data/reference/vllm_serve_args-<version>.json``: 0.32 dumped from the CPU build by
``tools/vllm_tier/dump_serve_args.py``, 0.33 from the GPU wheel) without installing vLLM.  Where one
spelling is valid in every recorded release it is the one written.  The release is ``--vllm-version``
when given, else the profile's ``vllm_version`` when lora-opt has its table, else
``twin.flags.DEFAULT_VLLM_VERSION`` (:func:`resolve_vllm_version`).  The real-vLLM test tier starts the
emitted command of a placement with vLLM 0.32 (tests/real_vllm/test_launch_real.py).
"""
from __future__ import annotations

import functools
import re

from lora_opt.placement.plan import GPUConfig, Placement
from twin.errors import ScenarioError
from twin.flags import DEFAULT_VLLM_VERSION, PER_INSTANCE_FLAGS, flag_values, release_key, serve_option
from twin.parsing import check_adapter_id, check_adapter_path, read_json_file
from twin.paths import VLLM_SERVE_ARGS_DIR

#: vLLM releases (major.minor) lora-opt writes launch commands for -> the option table of that
#: release's ``vllm serve`` parser
SERVE_ARG_TABLES = {"0.32": "vllm_serve_args-0.32.0.json", "0.33": "vllm_serve_args-0.33.0.json"}
# the release commands are written for when neither ``--vllm-version`` nor the profile names one of
# :data:`SERVE_ARG_TABLES` is ``twin.flags.DEFAULT_VLLM_VERSION`` (the H100 profiles were measured on
# vLLM 0.8.5, whose flags lora-opt does not write: their commands target the newest release it has a table for)
#: switches every command pins, each with its spellings across releases (the twin models neither
#: prefix caching nor async scheduling): :func:`switch_spelling` picks one
PINNED_SWITCHES = (("--no-enable-prefix-caching", "--disable-prefix-caching"), ("--no-async-scheduling",))


def release_of(version: str) -> str:
    """``"0.32.0+cpu"`` / ``"0.32.1"`` / ``"0.32"`` -> ``"0.32"`` (the major.minor a table is kept for)."""
    key = release_key(str(version))
    return f"{key[0]}.{key[1]}" if key else str(version)


def resolve_vllm_version(requested: str | None, profile_version: str | None = None,
                         error: type[Exception] = ScenarioError, where: str = "--vllm-version") -> str:
    """The release launch commands are written for: ``requested`` (refused unless lora-opt has its
    option table), else the profile's ``vllm_version`` when it has one, else ``DEFAULT_VLLM_VERSION``."""
    if requested is not None:
        release = release_of(requested)
        if release not in SERVE_ARG_TABLES:
            raise error(f"{where}: {requested!r}: lora-opt has vllm serve option tables for "
                        f"{', '.join(SERVE_ARG_TABLES)} (major.minor, e.g. 0.32 or 0.32.0)")
        return release
    if profile_version is not None and release_of(profile_version) in SERVE_ARG_TABLES:
        return release_of(profile_version)
    return DEFAULT_VLLM_VERSION


@functools.lru_cache(maxsize=None)
def serve_arg_table(version: str = DEFAULT_VLLM_VERSION) -> dict:
    """The recorded option table of ``version`` (``{"options": {...}, "vllm": "0.32.0"}``)."""
    release = release_of(version)
    if release not in SERVE_ARG_TABLES:
        raise ScenarioError(f"vLLM {version}: no vllm serve option table (have {', '.join(SERVE_ARG_TABLES)})")
    return read_json_file(VLLM_SERVE_ARGS_DIR / SERVE_ARG_TABLES[release], "vllm serve option table")


def serve_options(version: str = DEFAULT_VLLM_VERSION) -> dict:
    return serve_arg_table(version)["options"]


def switch_spelling(spellings: tuple[str, ...], version: str = DEFAULT_VLLM_VERSION) -> str:
    """The spelling of a pinned switch for ``version``: the first of ``spellings`` that every recorded
    release's parser accepts, else the first that ``version``'s accepts."""
    for s in spellings:
        if all(s in serve_options(v) for v in SERVE_ARG_TABLES):
            return s
    for s in spellings:
        if s in serve_options(version):
            return s
    raise ScenarioError(f"vLLM {version}: none of {spellings} is a vllm serve option")


def adapter_path(a) -> str:
    """Where an instance loads adapter ``a`` from: its ``path``, default ``adapters/<id>``."""
    return a.path or f"adapters/{a.id}"


def engine_args(g: GPUConfig) -> list[str]:
    """``--flag value`` for every set flag of ``g`` (``twin.flags.EngineFlags``' fields, spelled by
    ``twin.flags.serve_option``): the per-GPU flags, ``--max-model-len``, then the others in
    ``EngineFlags``' order -- the order launch commands have always had (committed ones are compared
    argument by argument)."""
    values = flag_values(g)
    first = [*PER_INSTANCE_FLAGS, "max_model_len"]
    args = []
    for name in first + [n for n in values if n not in first]:
        if values[name] is not None:
            args += [serve_option(name), str(values[name])]
    return args


def serve_command(p: Placement, gpu: int, model: str, *, host: str = "127.0.0.1", port: int = 8000,
                  adapters=None, vllm_version: str = DEFAULT_VLLM_VERSION, block_size: int = 16) -> list[str]:
    """argv of ``vllm serve`` for GPU ``gpu`` of the placement, in ``vllm_version``'s flags
    (``adapters``: its adapters, when the caller already has them; ``block_size``: the KV block the
    twin's profile assumes -- 16 on a GPU; vLLM's CPU build refuses 16, its profiles say 128)."""
    g = p.gpus[gpu]
    adapters = p.adapters_on(gpu) if adapters is None else adapters
    if not model or model.startswith("-") or any(not c.isprintable() for c in model):
        raise ScenarioError(f"model: {model!r:.80} cannot be a vllm serve argument (empty, a leading '-' or "
                            "control characters)")
    for a in adapters:                   # the launch rule, also for placements built in code
        check_adapter_id(a.id, f"adapter {a.id!r:.40}")
        if a.path is not None:
            check_adapter_path(a.path, f"adapter {a.id}.path")
    modules = [f"{a.id}={adapter_path(a)}" for a in adapters]
    argv = ["vllm", "serve", model, "--host", host, "--port", str(port), "--enable-lora", *engine_args(g),
            "--block-size", str(block_size), "--scheduling-policy", "fcfs",
            *(switch_spelling(s, vllm_version) for s in PINNED_SWITCHES)]
    if modules:
        argv += ["--lora-modules", *modules]
    return argv


def instance_urls(p: Placement, *, host: str = "127.0.0.1", base_port: int = 8000) -> list[str]:
    """Where GPU i's instance listens: a replanned placement's ``meta.endpoints`` when it has them, else
    ``http://host:base_port + i``."""
    known = p.meta.get("endpoints")
    if isinstance(known, list) and len(known) == len(p.gpus) and all(isinstance(u, str) for u in known):
        return [u.rstrip("/") for u in known]
    return [f"http://{host}:{base_port + g}" for g in range(len(p.gpus))]


def router_table(p: Placement, *, host: str = "127.0.0.1", base_port: int = 8000) -> dict:
    """adapter id -> [{"endpoint", "weight"}] (each GPU's instance where :func:`instance_urls` says)."""
    urls = instance_urls(p, host=host, base_port=base_port)
    return {aid: [{"endpoint": f"{urls[g]}/v1", "weight": w} for g, w in rs] for aid, rs in p.routes.items()}


#: argparse's rule (``_negative_number_matcher``): with no option that looks like a negative number,
#: as in vLLM's parser, such an argument is a value; any other argument starting with '-' is an option
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _is_option(arg: str) -> bool:
    return arg.startswith("-") and arg != "-" and not _NEGATIVE_NUMBER.match(arg)


def lora_module_problems(value: str) -> list[str]:
    """Why vLLM 0.32/0.33 would not read ``value`` of ``--lora-modules`` as the ``name=path`` lora-opt
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


def validate_serve_args(argv: list[str], vllm_version: str = DEFAULT_VLLM_VERSION) -> list[str]:
    """Problems with a ``vllm serve`` argv against ``vllm_version``'s option table (empty = valid):
    every option is in the table, flags take no value, values have the option's type and choices,
    and each ``--lora-modules`` value reads as the intended ``name=path``."""
    opts = serve_options(vllm_version)
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


def check_serve_args(argv: list[str], vllm_version: str = DEFAULT_VLLM_VERSION) -> None:
    problems = validate_serve_args(argv, vllm_version)
    if problems:
        raise ScenarioError(f"invalid vllm serve command for vLLM {release_of(vllm_version)}: " + "; ".join(problems))
