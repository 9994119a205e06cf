"""docs/architecture.md's "to add X, touch Y" table, checked by doing it (issue 27, item 5): a
throwaway placement policy, router and search objective (``tests/throwaway_extensions.py``: a class
or an entry and one registry line each) reach the CLI, the library and the contract tests with
nothing else touched; an engine flag added to ``twin.flags.EngineFlags`` (in a copy of the source)
is checked for reaching every place that holds engine flags.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import throwaway_extensions as ext

from lora_opt.cli import build_parser, main
from twin.paths import REPO_ROOT

WORKLOAD = """\
profile: llama-3.1-8b-h100-64gb
rho: 0.9
adapters:
  - {count: 6, rank: 8, rate: 0.2, prefix: t-}
evaluation: {arrivals: {process: poisson}, lengths: sharegpt, duration_s: 30, seed: 0}
"""


@pytest.fixture
def registered():
    ext.register()
    yield
    ext.unregister()


def test_the_cli_offers_what_the_registries_hold(registered, tmp_path):
    wl = tmp_path / "wl.yaml"
    wl.write_text(WORKLOAD)
    parse = build_parser().parse_args
    assert parse(["place", "--workload", str(wl), "--gpus", "2", "--policy", ext.POLICY]).policy == ext.POLICY
    assert parse(["evaluate", "p.json", "--router", ext.ROUTER]).router == ext.ROUTER
    assert parse(["search", "--workload", str(wl), "--gpus", "2", "--objective", ext.OBJECTIVE]).objective == ext.OBJECTIVE
    assert parse(["pareto", "--workload", str(wl), "--objective", ext.OBJECTIVE]).objective == ext.OBJECTIVE


def test_a_policy_and_a_router_run_end_to_end(registered, tmp_path, capsys):
    """place with the new policy, evaluate its placement with the new router (the fleet twin), and
    the new objective read off that evaluation -- each known only through its registry."""
    from lora_opt.search.study import objective_value

    wl = tmp_path / "wl.yaml"
    wl.write_text(WORKLOAD)
    out = tmp_path / "placed"
    rc = main(["place", "--workload", str(wl), "--gpus", "2", "--policy", ext.POLICY, "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    placement = json.loads((out / "placement.json").read_text())
    assert placement["policy"] == ext.POLICY and len(placement["gpus"]) == 2
    ev_file = tmp_path / "ev.json"
    rc = main(["evaluate", str(out / "placement.json"), "--workload", str(wl), "--router", ext.ROUTER,
               "--duration-s", "30", "--grace-s", "5", "--out", str(ev_file), "--no-track"])
    assert rc in (0, 3), capsys.readouterr().err           # 3: a GPU starves -- still a result
    ev = json.loads(ev_file.read_text())
    assert objective_value(ev, ext.OBJECTIVE) == ev["ttft_ms"]["median"]


def test_the_contract_tests_run_over_the_new_policy_and_router():
    """The contract tests parametrize over the registries: with the three registered before
    collection (as a plugin), they run over the new ones too, and pass."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "throwaway_extensions", "-p", "no:cacheprovider",
                        "tests/test_policies.py", "tests/test_routers.py", "-k", "throwaway"],
                       cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", r.stdout).group(1))
    assert passed >= 8, r.stdout[-2000:]      # the policy's 5 contract tests, the routers' 3


#: where an engine flag must arrive once it is declared in EngineFlags (the table's last row); each
#: check on its own, so the output says which places still list the flags by hand
FLAG_PROBE = textwrap.dedent("""
    import dataclasses, json
    from lora_opt.cli import build_parser
    from lora_opt.emulate.fleet import spec_from_flags
    from lora_opt.placement.plan import Adapter, GPUConfig, Placement
    from lora_opt.placement.policies.base import gpu_config
    from lora_opt.placement.vllm_launch import serve_command
    from lora_opt.placement.workload_file import workload_from_dict
    from twin.engine_state import Config
    from twin.flags import KERNEL_FLAGS, EngineFlags
    from twin.profile import Profile, load_profile
    from twin.scenario import build_scenario
    from twin.simulate import kernel_config, simulate
    names = lambda cls: {f.name for f in dataclasses.fields(cls)}
    prof = load_profile("llama-3.1-8b-h100-64gb")
    out = {"EngineFlags": "throwaway_flag" in names(EngineFlags), "GPUConfig": "throwaway_flag" in names(GPUConfig)}
    # the workload file: its engine: section takes the flag, the GPU's flags carry it -- and carry the
    # declared default when the workload is silent (GPUConfig: every flag set)
    spec = {"profile": prof.name, "adapters": [{"id": "a", "rank": 8, "rate": 1.0}]}
    try:
        wl = workload_from_dict({**spec, "engine": {"throwaway_flag": 3}})
        cfg = gpu_config(wl, prof, [8], 1, 1)
        out["workload engine section -> GPUConfig"] = cfg.throwaway_flag == 3
    except Exception as exc:
        out["workload engine section -> GPUConfig"] = repr(exc)[:200]
        cfg = None
    out["GPUConfig set by the declared default"] = gpu_config(workload_from_dict(spec), prof, [8], 1, 1).throwaway_flag == 7
    # startup_check and the kernel: a scenario made from the GPU's flags, simulated
    seen = []
    check = Profile.startup_check
    Profile.startup_check = lambda self, flags: (seen.append(getattr(flags, "throwaway_flag", None)), check(self, flags))[1]
    sc = build_scenario(prof.name, [{"rank": 8, "rate": 1.0}], engine=cfg, duration_s=5)
    res = simulate(sc)
    out["Scenario.resolved_engine"] = sc.resolved_engine(prof).throwaway_flag == 3
    out["Profile.startup_check"] = seen == [3]
    out["the kernel's Config"] = ("throwaway_flag" in KERNEL_FLAGS and "throwaway_flag" in Config._fields
                                  and kernel_config(sc, prof, res.engine, res.kv_cache_tokens).throwaway_flag == 3
                                  and res.status == "ok" and res.completed > 0)
    # the emulator's options: --throwaway-flag, into the instance it serves
    args = build_parser().parse_args(["emulate", "--profile", prof.name, "--lora-modules", "a=/x", "--throwaway-flag", "3"])
    inst = spec_from_flags(prof.name, args.lora_modules, {n: getattr(args, n) for n in names(EngineFlags)},
                           port=8000, host="127.0.0.1")
    out["emulate --throwaway-flag"] = inst.scenario.resolved_engine(prof).throwaway_flag == 3
    # vllm serve
    p = Placement(profile=prof.name, adapters=[Adapter(id="a", rank=8, rate=1.0)], gpus=[cfg], routes={"a": [(0, 1.0)]})
    argv = serve_command(p, 0, "m")
    out["vllm_launch.serve_command"] = argv[argv.index("--throwaway-flag") + 1] == "3"
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_an_engine_flag_needs_only_its_field_in_engine_flags(tmp_path):
    """Copy twin/ and lora_opt/, declare one more field in EngineFlags -- read by the kernel, with a
    default of its own -- and see it reach the workload file, the GPU's flags, startup_check, the
    kernel, the emulator's options and vllm serve."""
    for pkg in ("twin", "lora_opt"):
        shutil.copytree(REPO_ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for data in ("configs", "data"):
        (tmp_path / data).symlink_to(REPO_ROOT / data)
    # declared last: GPUConfig makes the flags before it required again
    flags = tmp_path / "twin" / "flags.py"
    anchor = '    for one request of this length."""\n'
    src = flags.read_text()
    assert src.count(anchor) == 1
    flags.write_text(src.replace(anchor, anchor + "    throwaway_flag: int | None = engine_flag(kernel=True, vllm_default=7)\n"
                                 '    """``--throwaway-flag``."""\n', 1))
    r = subprocess.run([sys.executable, "-c", FLAG_PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    reached = json.loads(r.stdout.strip().splitlines()[-1])
    assert reached["EngineFlags"], "the copy did not take the new field"
    assert {k: v for k, v in reached.items() if v is not True} == {}
