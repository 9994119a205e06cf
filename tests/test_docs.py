"""The documentation is a product: the site builds with ``mkdocs build --strict``, its generated
references are what the code says, the README's links land, and every ``lora-opt`` command shown in
a code block of the README or the docs is one the parser accepts.

* The site needs the ``docs`` extra (``pip install -e ".[docs]"``; ``dev`` includes it): without it the
  build test skips saying so, except under CI (``CI`` set), where a missing extra fails.
* Commands (in code blocks, and inline in the prose): each one is parsed by ``lora_opt.cli.build_parser`` -- the subcommand and every flag must
  exist, a flag's value must be one of its choices; a command written with concrete values (no
  placeholders such as ``W.yaml`` or ``K``) must parse whole, as ``lora-opt`` would run it. Commands
  that need a GPU or a live vLLM endpoint (``validate``, ``probe``) are only parsed here; their ids say
  ``needs-live-vllm``, and tests/real_vllm/ runs them against the real-vLLM tier.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import html.parser
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lora_opt import cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: pages whose code blocks show commands (the generated CLI reference shows usage lines, not commands)
PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if p != DOCS / "reference" / "cli.md")]
#: commands that need a GPU or a live vLLM endpoint: parsed here, run by tests/real_vllm/
NEEDS_LIVE_VLLM = {"validate", "probe", "apply"}
#: a placeholder the docs write where the user puts a value: W.yaml, K, DIR, LOG.csv, URI, ...
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.[a-z]+)?$|\.\.\.|^<.*>$")


@functools.cache
def _gen_reference():
    """tools/docs/gen_reference.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "docs" / "gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- the generated references -------------------------------------------------------------------

def test_generated_references_are_current():
    for path, text in _gen_reference().generated().items():
        assert path.is_file() and path.read_text() == text, \
            f"{path.relative_to(ROOT)} is stale: run python tools/docs/gen_reference.py"


def test_every_input_dataclass_field_is_documented_or_listed():
    """The configuration reference takes a field's text from its docstring: a field without one
    shows an empty cell. The fields still without a docstring are listed here, so a new one fails."""
    gen = _gen_reference()
    undocumented = {f"{cls.__name__}.{f.name}" for _, _, sections in gen._config_files() for _, cls in sections
                    for f in dataclasses.fields(cls) if not gen._field_doc(cls, f.name)}
    assert undocumented <= KNOWN_UNDOCUMENTED, sorted(undocumented - KNOWN_UNDOCUMENTED)


#: fields whose meaning is their section's table (a nested section) or still lacks a docstring
KNOWN_UNDOCUMENTED = {
    "Scenario.engine", "Scenario.arrivals", "Scenario.lengths", "Workload.engine", "Workload.evaluation",
    "Profile.model", "Profile.memory", "Profile.latency", "Profile.loading", "Profile.defaults", "Profile.source",
    "Placement.profile", "Placement.adapters", "Placement.gpus", "Placement.routes", "Placement.policy",
    "Placement.meta",
}


# ---- the site -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built with --strict into a temporary directory (a warning fails the build)."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        if os.environ.get("CI"):
            pytest.fail("mkdocs / mkdocs-material missing under CI: the dev extra includes the docs extra")
        pytest.skip('the docs site needs the docs extra: pip install -e ".[docs]"')
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _built(site: Path, page: Path) -> Path:
    """The HTML file mkdocs makes of a page (``a/b.md`` -> ``a/b/index.html``: directory URLs)."""
    rel = page.with_suffix("")
    return site / "index.html" if rel == Path("index") else site / rel / "index.html"


def test_the_site_builds_strict_with_every_page(site):
    for page in DOCS.rglob("*.md"):
        built = _built(site, page.relative_to(DOCS))
        assert built.is_file(), f"{page.relative_to(ROOT)} was not built (missing from nav?)"
    assert (site / "img" / "pipeline.png").is_file()


class _Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.ids.update(v for k, v in attrs if k == "id" and v)


def test_readme_links_land_on_a_docs_page_and_anchor(site):
    """The README is read on the repository's front page: its relative links are not checked by
    mkdocs, so here, against the built site's anchors."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links, "the README links to the docs"
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
        if anchor:
            built = _built(site, Path(target).relative_to("docs"))
            ids = _Ids()
            ids.feed(built.read_text())
            assert anchor in ids.ids, f"README links to {link}: no anchor #{anchor} on that page"


def test_the_readme_keeps_the_two_commands_and_stays_short():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    blocks = re.findall(r"```bash\n(.*?)\n```", readme.split("## Two commands", 1)[1], re.S)
    assert ci.endswith(blocks[1]), "the README's test command is the one .ci/run runs"
    assert "](docs/img/pipeline.png)" in readme


# ---- every command the docs show ----------------------------------------------------------------

def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)


def _commands(block: str) -> list[list[str]]:
    """The ``lora-opt`` command lines of a shell block, as argv lists (continuations joined,
    comments dropped, ``&&`` / ``;`` chains split); synopsis brackets are kept as tokens' text."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        segment: list[str] = []
        for tok in [*tokens, "&&"]:
            if tok in ("&&", "||", ";", "&") or tok.endswith(";"):
                if segment and segment[0] == "lora-opt":
                    out.append(segment[1:])
                segment = []
            else:
                segment.append(tok)
    return out


def _inline_commands(text: str) -> list[str]:
    """``lora-opt ...`` written as inline code in the prose (outside code blocks)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    # a command, not a name (`lora-opt place`) nor a message format (`lora-opt CMD: error: ...`)
    return [c for c in re.findall(r"`(lora-opt [^`]+)`", prose) if re.match(r"lora-opt (-\S+ )*[a-z-]+ \S", c)]


def _documented_commands():
    seen, params = set(), []
    for page in PAGES:
        text = page.read_text()
        for block in [*_code_blocks(text), *_inline_commands(text)]:
            for argv in _commands(block):
                key = tuple(argv)
                if key in seen:
                    continue
                seen.add(key)
                command = next((t for t in argv if not t.startswith("-")), "")
                live = "needs-live-vllm: " if command in NEEDS_LIVE_VLLM else ""
                params.append(pytest.param(argv, id=f"{live}{page.relative_to(ROOT)}: lora-opt {' '.join(argv)}"[:150]))
    return params


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return _gen_reference().subcommands(parser)[0].choices


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings}


def _check_flags(argv: list[str], parser: argparse.ArgumentParser) -> None:
    """Every flag of a (possibly synopsis-style) command exists, and a value given for a flag with
    choices is one of them (``a|b`` alternatives each)."""
    top = _options(parser)
    words = [t.strip("[]") for t in argv]
    words = [w for w in words if w and w not in ("|", "...")]
    i = 0
    while i < len(words) and words[i].startswith("-"):        # global flags before the command
        assert words[i].split("=")[0] in top, f"unknown global flag {words[i]}"
        i += 1 + (top[words[i]].nargs != 0 and "=" not in words[i])
    if i == len(words):                                       # lora-opt --version / --help
        assert any(w in ("--version", "-h", "--help") for w in words), "no command"
        return
    commands = _subparsers(parser)
    assert words[i] in commands, f"unknown command {words[i]!r} (commands: {', '.join(commands)})"
    sub = commands[words[i]]
    flags = _options(sub)
    for k, w in enumerate(words[i + 1:], start=i + 1):
        if not w.startswith("-") or re.fullmatch(r"-[\d.]+", w):
            continue
        name = w.split("=")[0]
        assert name in flags, f"lora-opt {words[i]}: no flag {name} (flags: {', '.join(sorted(flags))})"
        action = flags[name]
        if action.choices is not None and k + 1 < len(words):
            for value in words[k + 1].split("|"):
                if not PLACEHOLDER.search(value):
                    assert value in action.choices, f"lora-opt {words[i]} {name}: {value!r} not in {action.choices}"


@pytest.mark.parametrize("argv", _documented_commands())
def test_every_documented_command_is_one_the_parser_accepts(argv, capsys):
    parser = cli.build_parser()
    _check_flags(argv, parser)
    synopsis = any(re.search(r"[\[\]|]", t) or PLACEHOLDER.search(t) for t in argv)
    if not synopsis:
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code == 0:                                 # --version, --help
                return
            pytest.fail(f"lora-opt {' '.join(argv)}: refused by the parser (exit {exc.code}): "
                        f"{capsys.readouterr().err.strip()}")


def test_the_docs_show_commands_of_every_kind():
    """The extraction above finds the commands (a regression here would make the test vacuous)."""
    commands = {next((t for t in p.values[0] if not t.startswith("-")), "") for p in _documented_commands()}
    assert {"place", "evaluate", "simulate", "search", "emulate", "validate", "probe"} <= commands


# ---- which documented commands run, and where ---------------------------------------------------

#: concrete documented commands run here, in a temporary directory (outputs go under the current
#: directory; configs/ and data/ are linked in so that repository paths resolve): seconds each
RUN_HERE = {"--version", "simulate example"}
#: the same, minutes on 2 cores (the main job with twin verification): under -m slow
RUN_SLOW = {"place --workload configs/workloads/example.yaml --gpus 4 --emit-vllm",
            "place --workload example --gpus 4 --emit-vllm", "place --workload example --gpus 4",
            "place --workload example --gpus 4 --deployment static"}
#: concrete documented commands not run here, and why (each is parsed above all the same)
NOT_RUN_HERE = {
    "emulate --instances 2 --router round-robin": "a fleet that serves until stopped; "
        "tests/test_router_health.py starts it (with --port, --router-port) and shuts one instance down",
    "probe --launch out/vllm/serve_commands.txt --gpu-index 0 --quick --model llama-3.1-8b-h100-64gb "
    "--adapter-path adapters/r{rank} --out probe/": "needs a GPU; tests/real_vllm/test_probe_real.py runs probe --launch on the tier",
    "validate out/placement.json --endpoints out/router.json --duration 600":
        "needs live endpoints; tests/test_validate.py (emulator) and tests/real_vllm/test_validate_real.py",
    "ingest validation/ --label h100-run1 --out rows.csv": "needs a validate directory; tests/test_validate.py ingests one",
    "ingest validation/ --out rows.csv": "needs a validate directory; tests/test_validate.py ingests one",
    "fidelity --runs rows.csv": "needs ingested rows; tests/test_validate.py",
    "fidelity --out experiments/fidelity --before experiments/fidelity/before/summary.json":
        "replays all 445 real runs (~2 min) and rewrites the committed report; tests/test_fidelity.py runs fidelity "
        "on a small family and tests/test_residuals.py the before / after table",
    "place --workload example --gpus 4 --confidence 0.99":
        "tests/test_confidence.py runs it beside the default confidence (it needs one GPU more)",
    "evaluate outputs/placement-example --confidence 0.9":
        "needs the placement place writes; tests/test_confidence.py evaluates one at a confidence",
    "error-model --out experiments/error_model --models-dir configs/error_models":
        "rewrites the bundled error models; tests/test_confidence.py (slow) refits into a temporary directory "
        "and compares",
    "calibrate --runs probe/rows.csv --model probe-llama --out configs/profiles/probe-llama-cpu-vllm032.yaml":
        "rewrites a bundled profile from the CPU server's probe rows; experiments/real_validation/cpu_loop.py runs it",
    "calibrate --runs probe/rows.csv --model llama-3.1-8b-h100-64gb --out configs/profiles/mine.yaml":
        "needs probe rows from a GPU; tests/real_vllm/test_probe_real.py runs probe then calibrate",
    "calibrate --runs data/real_runs/real_runs_vllm_lora.csv --model llama-3.1-8b-instruct --out "
    "configs/profiles/llama-3.1-8b-h100-64gb.yaml --report experiments/calibration/llama":
        "rewrites a bundled profile; tests/test_calibrate.py fits the same data into a temporary file",
    "emulate --scenario configs/scenarios/example.yaml --port 8000": "a server that runs until stopped; tests/test_emulate.py",
    "emulate --profile llama-3.1-8b-h100-64gb --max-loras 4 --max-lora-rank 16 --lora-modules sql=adapters/sql "
    "chat=adapters/chat --port 8000": "a server that runs until stopped; tests/test_emulate.py",
    "emulate --placement out/placement.json --router-port 9000": "a server fleet that runs until stopped; tests/test_emulate.py",
    "emulate --placement out/placement.json --router-port 9000 --router lora-affinity --adapters on-demand":
        "a server fleet that runs until stopped; tests/test_emulate_fleet.py",
    "emulate --profile llama-3.1-8b-h100-64gb --model ./tiny-llama --served-model-name tiny-llama --max-loras 2 "
    "--max-lora-rank 32 --max-model-len 512 --lora-modules a=adapters/a --vllm-version 0.32":
        "needs the tier's model directory; tests/real_vllm/test_conformance.py starts it so",
    "dataset --grid heldapart --profile llama-3.1-8b-h100-64gb --out outputs/dataset-heldapart-llama":
        "35 s of labelling on 2 cores; tests/test_surrogate.py conformalizes on a small held-apart frame",
    "train --dataset outputs/dataset-heldapart-llama --out configs/surrogates/llama-3.1-8b-h100-64gb --intervals-only":
        "rewrites the bundled surrogate's intervals; tests/test_surrogate.py runs --intervals-only on a copy",
    "dataset --grid papers --out outputs/dataset-llama": "the papers' grid: about an hour on 2 cores",
    "dataset --grid papers --out outputs/dataset-papers-llama": "the papers' grid: about an hour on 2 cores",
    "dataset --grid workloads --out outputs/dataset-workloads-llama": "about 24 minutes on 2 cores",
    "train --dataset outputs/dataset-workloads-llama --out outputs/surrogate-workloads-llama": "needs that dataset",
    "dataset --grid tiny --out outputs/tiny --workers 1": "about 3 minutes with train on 2 cores; tests/test_cli.py labels the tiny grid",
    "train --dataset outputs/tiny --out outputs/surrogate-tiny": "needs the tiny dataset (with it: about 3 minutes)",
    "search --workload configs/workloads/example.yaml --gpus 4 --trials 16": "minutes; tests/test_search.py runs small studies",
    "bench search": "a benchmark (minutes); run by hand", "bench emulate": "a benchmark (minutes); run by hand",
    "bench ray": "a benchmark; run by hand", "bench dataset --sample 1024": "a benchmark (minutes); run by hand",
    "bench twin": "a benchmark; tests/test_bench_twin.py", "bench twin --out experiments/bench/twin.json":
        "rewrites committed results; tests/test_bench_twin.py", "bench place": "a benchmark; tests/test_bench_place.py",
    "bench place --out experiments/bench/place.json": "rewrites committed results; tests/test_bench_place.py",
    "bench fleet": "a benchmark (minutes); tests/test_fleet.py runs a small one",
    "bench fleet --out experiments/bench/fleet.json": "rewrites committed results; tests/test_fleet.py runs a small one",
    "place --workload my.yaml --gpus 8 --policy greedy-plus --emit-vllm --out placed":
        "a user's own workload file (docs/operate.md's walk-through); tests/test_hardening.py places with --emit-vllm",
    "emulate --routes placed/router.json --router-port 9000": "a router that runs until stopped; tests/test_reconcile.py",
    "emulate --routes placed/router.json --router-port 9000 --retry-for-s 30":
        "a router that runs until stopped; tests/test_reconcile.py",
    "operate placed --prometheus http://127.0.0.1:9090 --router http://127.0.0.1:9000 --window 15m --interval-s 900 "
    "--reconcile-s 10 --out operate": "a loop against a live fleet; tests/test_operate.py, experiments/operate_faults.py",
    "schedule --drift traces": "a day of replans (minutes); experiments/drift_day.py --drift traces runs it, "
                               "tests/test_schedule.py runs small ones",
}


def _concrete_commands() -> list[str]:
    out = []
    for p in _documented_commands():
        argv = p.values[0]
        if not any(re.search(r"[\[\]|]", t) or PLACEHOLDER.search(t) for t in argv):
            out.append(" ".join(argv))
    return out


def test_every_concrete_documented_command_is_run_or_says_why_not():
    """A command added to the docs with concrete values must be run here or listed with its reason."""
    unaccounted = [c for c in _concrete_commands() if c not in RUN_HERE | RUN_SLOW | set(NOT_RUN_HERE)]
    assert not unaccounted, f"run these in tests/test_docs.py or say why not (NOT_RUN_HERE): {unaccounted}"
    stale = (RUN_HERE | RUN_SLOW | set(NOT_RUN_HERE)) - set(_concrete_commands())
    assert not stale, f"no longer in the docs: {sorted(stale)}"


def _run_documented(command: str, tmp_path: Path, monkeypatch) -> None:
    for name in ("configs", "data"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlruns.db")
    assert cli.main(shlex.split(command)) == 0, f"lora-opt {command}"


@pytest.mark.parametrize("command", sorted(RUN_HERE))
def test_documented_command_runs(command, tmp_path, monkeypatch, capsys):
    _run_documented(command, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(RUN_SLOW))
def test_documented_command_runs_slow(command, tmp_path, monkeypatch, capsys):
    _run_documented(command, tmp_path, monkeypatch)
    out = capsys.readouterr().out
    if command.startswith("place") and "--deployment static" not in command:
        # the main job's default: the recommendation and why each other deployment lost, the runner-up named
        # first when another deployment meets the SLO too (the table's "yes" rows), the chosen deployment's files
        assert "recommended: " in out, out
        chosen = out.split("recommended: ")[1].split(" on ")[0]
        met = {row.split()[0] for row in out.split("meets SLO")[1].split("recommended: ")[0].splitlines()[1:]
               if row.split()[2:3] == ["yes"]}
        assert chosen in met and ("runner-up: " in out) == bool(met - {chosen}), out
    if "--emit-vllm" in command:
        assert list(tmp_path.glob("outputs/*/vllm/serve_commands.txt")), "place --emit-vllm wrote the launch commands"
        # a pick judged behind a router comes with that router's configuration (the note names the file)
        config = re.search(r"route with it \((router/\S+) has ", out)
        chosen = out.split("recommended: ")[1].split(" on ")[0] if "recommended: " in out else "static"
        assert chosen == "static" or (config and list(tmp_path.glob(f"outputs/*/{config.group(1)}"))), out
