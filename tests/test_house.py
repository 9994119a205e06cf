"""The house stays easy to extend: measured limits on the code's shape (issue: the redesign).

No import cycles between project modules; a pipeline stage imports only the stages before it
(``STAGES``: docs/architecture.md's order); project modules imported at module level (function-level
imports are for heavy optional dependencies -- Ray, MLflow, Optuna, matplotlib, sklearn -- and for
the CLI's start-up time); no function over 80 lines or with more than 12 parameters; no module
over 600 lines.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("twin", "lora_opt")
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 12
MAX_MODULE_LINES = 600
# modules whose function-level project imports keep start-up fast (one command imports only its own code)
LAZY_IMPORTERS = ("lora_opt.cli",)


def _modules(packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> path of every Python file below ``packages`` (folders of the repository)."""
    out = {}
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _trees():
    return {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _project_target(name: str, node: ast.AST, current: str) -> list[str]:
    """Project modules an import statement names (``from a.b import c`` -> a.b.c if a module, else a.b)."""
    found = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in MODULES:
                found.append(alias.name)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        for alias in node.names:
            sub = f"{node.module}.{alias.name}"
            if sub in MODULES:
                found.append(sub)
            elif node.module in MODULES:
                found.append(node.module)
    return [f for f in found if f != current]


def _imports(tree: ast.Module, current: str, *, module_level: bool) -> set[str]:
    out = set()
    nodes = tree.body if module_level else ast.walk(tree)
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(_project_target(current, node, current))
        elif module_level and isinstance(node, (ast.If, ast.Try)):   # guarded module-level imports
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    out.update(_project_target(current, sub, current))
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    trees = _trees()
    # every import counts, function-level ones included: a cycle closed inside a function is still a cycle
    graph = {}
    for name, tree in trees.items():
        targets = _imports(tree, name, module_level=False)
        # a package's own __init__ importing its submodules, and a submodule importing its parent
        # package, is Python's normal re-export, not a design cycle
        graph[name] = {t for t in targets if not (t.startswith(name + ".") or name.startswith(t + "."))}
    assert _cycles(graph) == []


#: the pipeline, in order (docs/architecture.md): a module may import its own stage and the ones
#: before it, never a later one.  Each entry lists module-name prefixes; every project module must
#: fall in one (a new top-level module is placed here deliberately).
STAGES: tuple[tuple[str, ...], ...] = (
    ("twin",),
    # the shared helpers every stage may use
    ("lora_opt", "lora_opt.errors", "lora_opt.smape", "lora_opt.io", "lora_opt.no_network_env", "lora_opt.parallel",
     "lora_opt.tracking", "lora_opt.http_pool"),
    ("lora_opt.calibration",),
    ("lora_opt.surrogates",),
    ("lora_opt.placement",),
    # re-placement: placements moved to a new demand (and the router settings the emulated router shares)
    ("lora_opt.replan",),
    ("lora_opt.search",),
    ("lora_opt.emulate",),
    ("lora_opt.validate",),
    ("lora_opt.probe",),
    # a replan carried out on a live fleet (launches as probe does, measures as validate does)
    ("lora_opt.apply",),
    # tooling over the stages: the benchmarks (the docs' generated blocks are written by experiments/)
    ("lora_opt.bench",),
    ("lora_opt.cli", "lora_opt.__main__"),
)
#: imports against the order, each with why it is tolerated (an entry that no longer occurs fails)
KNOWN_BACKWARD_IMPORTS: set[tuple[str, str]] = set()


def _stage(module: str) -> int | None:
    """Index in STAGES of the longest prefix matching ``module`` (``lora_opt`` itself: only the
    package's ``__init__``, so that a new top-level module has no stage until it is given one)."""
    best, best_len = None, -1
    for i, prefixes in enumerate(STAGES):
        for p in prefixes:
            if (module == p or (p != "lora_opt" and module.startswith(p + "."))) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def test_every_module_has_a_stage():
    assert [m for m in MODULES if _stage(m) is None] == [], "place the module in tests/test_house.py STAGES"


def test_a_stage_imports_only_the_stages_before_it():
    backward = set()
    for name, tree in _trees().items():
        for target in _imports(tree, name, module_level=False):      # function-level imports count too
            if _stage(target) > _stage(name):
                backward.add((name, target))
    assert backward - KNOWN_BACKWARD_IMPORTS == set(), "a stage imports a later stage"
    assert KNOWN_BACKWARD_IMPORTS <= backward, f"fixed: drop {sorted(KNOWN_BACKWARD_IMPORTS - backward)}"


def test_project_imports_at_module_level():
    trees = _trees()
    offenders = []
    for name, tree in trees.items():
        if name.startswith(LAZY_IMPORTERS):
            continue
        inside = _imports(tree, name, module_level=False) - _imports(tree, name, module_level=True)
        offenders += [f"{name} -> {t}" for t in sorted(inside)]
    assert offenders == []


def _functions():
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield name, node


@pytest.mark.parametrize("limit", ["lines", "parameters"])
def test_function_size(limit):
    offenders = []
    for name, fn in _functions():
        if limit == "lines":
            n = fn.end_lineno - fn.lineno + 1
            bound = MAX_FUNCTION_LINES
        else:
            a = fn.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
            n = len(params) + (a.vararg is not None) + (a.kwarg is not None)
            n -= bool(params) and params[0].arg in ("self", "cls")
            bound = MAX_PARAMETERS
        if n > bound:
            offenders.append(f"{name}.{fn.name}: {n} {limit} (max {bound})")
    assert offenders == []


def test_module_size():
    offenders = [f"{name}: {path.read_text().count(chr(10))} lines" for name, path in MODULES.items()
                 if path.read_text().count("\n") > MAX_MODULE_LINES]
    assert offenders == []


def test_package_data_patterns_match_files():
    """Every package-data pattern in pyproject.toml names files that exist (a pattern that matches
    nothing builds a wheel silently missing them)."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data.get("tool", {}).get("setuptools", {}).get("package-data", {})
    mapped = data.get("tool", {}).get("setuptools", {}).get("package-dir", {})   # e.g. configs/ -> twin._bundled
    empty = [f"{pkg}: {pat}" for pkg, pats in patterns.items() for pat in pats
             if not any(p.is_file() for p in (ROOT / mapped.get(pkg, pkg.replace(".", "/"))).glob(pat))]
    assert empty == []


def test_missing_bundled_profiles_directory_is_a_clean_error(monkeypatch, tmp_path):
    from twin import paths, profile
    from twin.errors import ScenarioError

    monkeypatch.setitem(paths.NAMED_KINDS, "profile", tmp_path / "nowhere")
    with pytest.raises(ScenarioError, match="bundled profiles are missing"):
        profile.load_profile("llama-3.1-8b-h100-64gb")


# ---- no private names across modules -----------------------------------------------------------
#: the code that may import a project module: the product and the scripts beside it
IMPORTER_DIRS = ("twin", "lora_opt", "experiments", "tools")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """``from m import _x`` and ``m._x`` in module ``name`` where ``m`` is another project module."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    aliases, out = {}, []                       # local name -> the project module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:                      # relative: from the package, up level - 1
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([source] if source else []))
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
                elif _private(alias.name) and source in modules and source != name:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} from {source} import {alias.name}")
        elif isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in modules})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            dotted, value = [], node.value
            while isinstance(value, ast.Attribute):
                dotted.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                target = ".".join([aliases[value.id], *dotted])
                if target in modules and target != name:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {target}.{node.attr}")
    return out


def test_no_private_names_imported_across_modules():
    """A name with a leading underscore belongs to its module: another module using it
    (``from m import _x``, ``m._x``) makes it public in all but name -- rename it, or move it."""
    modules = _modules(IMPORTER_DIRS)
    offenders = [use for name, path in modules.items() for use in _private_uses(name, path, modules)]
    assert offenders == []


def test_the_private_name_check_sees_both_spellings(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("def _x(): pass\n_x()\n")
    (tmp_path / "pkg" / "b.py").write_text("from pkg.a import _x\nfrom . import a\nimport pkg.a as m\na._x()\nm._x()\n")
    modules = _modules(("pkg",))
    assert [u.split(" ", 1)[1] for u in _private_uses("pkg.b", modules["pkg.b"], modules)] == \
        ["from pkg.a import _x", "pkg.a._x", "pkg.a._x"]
    assert _private_uses("pkg.a", modules["pkg.a"], modules) == []


# ---- every file read through twin.parsing ------------------------------------------------------
#: the parsers that would read a file without twin.parsing's limits (size, depth, duplicate keys,
#: NaN, a message naming the file): ``twin.parsing`` calls them, nothing else does on a file
RAW_LOADERS = {("yaml", "safe_load"), ("yaml", "load"), ("yaml", "safe_load_all"), ("yaml", "load_all"),
               ("yaml", "full_load"), ("yaml", "unsafe_load"), ("json", "load"), ("json", "loads")}
#: (module, function) that parse JSON that is not a file, each with why
RAW_LOADER_USES = {
    ("lora_opt.bench.emulate", "_get"): "an HTTP answer of the emulator it benchmarks",
    ("lora_opt.bench.prometheus_server", "_scraped_once"): "an HTTP answer of Prometheus's API",
    ("lora_opt.bench.search_backends", "bench_backends"): "a round trip of its own rows (plain JSON types)",
    ("lora_opt.bench.stages", "_run"): "the result line its own child process prints",
    ("lora_opt.bench.stages", "bench_ray"): "the result line its own child process prints",
    ("lora_opt.cli.pareto", "run"): "a round trip of the result for printing (NaN -> null)",
    ("lora_opt.emulate.client", "error_message"): "an HTTP error body of the server it sends to",
    ("lora_opt.emulate.request_validation", "read_json_body"): "an HTTP request body, parsed as vLLM parses it",
    ("lora_opt.emulate.router", "model_of"): "an HTTP request body (the model a request names)",
    ("lora_opt.emulate.router", "admin_call"): "an HTTP request body of the router's admin API",
    ("lora_opt.placement.prometheus_demand", "get"): "an HTTP answer of Prometheus's API",
    ("lora_opt.probe.plan", "server_info"): "HTTP answers of the server probed (/v1/models, /version)",
    ("lora_opt.validate.live", "one"): "HTTP answers of an instance (/version, /emulator/stats)",
}


def _raw_loader_calls(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function, line) of every ``yaml.<load>(...)`` / ``json.load(s)(...)`` call."""
    out = []

    def walk(node, function):
        for child in ast.iter_child_nodes(node):
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and isinstance(child.func.value, ast.Name) and (child.func.value.id, child.func.attr) in RAW_LOADERS):
                out.append((function, child.lineno))
            walk(child, child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function)

    walk(tree, "<module>")
    return out


def test_every_file_is_read_through_twin_parsing():
    """A file a user hands in -- a workload, a plan, a stored run, a surrogate, a profile -- is read by
    ``twin.parsing`` (``read_config_file`` / ``read_json_file``), so that bad input is a clean error
    naming the file (exit 2), never a traceback; JSON that is not a file is listed with its reason."""
    found = set()
    for name, tree in _trees().items():
        if name == "twin.parsing":
            continue
        found |= {(name, function) for function, _ in _raw_loader_calls(tree)}
    assert found - set(RAW_LOADER_USES) == set(), "read files with twin.parsing.read_config_file / read_json_file"
    assert set(RAW_LOADER_USES) <= found, f"fixed: drop {sorted(set(RAW_LOADER_USES) - found)}"


def _script_imports(folder: Path) -> dict[str, set[str]]:
    """Sibling imports of the scripts in ``folder`` (run as scripts, their folder is on the path:
    ``import x`` / ``from x import y`` name a sibling ``x.py``; ``from . import x`` / ``from .x import y``
    too where the folder is a package)."""
    siblings = {p.stem for p in folder.glob("*.py")}
    graph = {}
    for path in sorted(folder.glob("*.py")):
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in siblings}
            elif isinstance(node, ast.ImportFrom) and node.level in (0, 1):
                if node.module in siblings:
                    targets.add(node.module)
                elif node.level == 1 and node.module is None:
                    targets |= {a.name for a in node.names if a.name in siblings}
        graph[path.stem] = targets - {path.stem}
    return graph


def test_no_import_cycles_among_the_experiments_scripts():
    """The scripts beside the product keep the house's first rule too: no two import each other, even
    inside a function (what both need lives in a module of its own)."""
    folders = {p.parent for d in ("experiments", "tools") for p in (ROOT / d).rglob("*.py")}
    cycles = {str(f.relative_to(ROOT)): c for f in sorted(folders) if (c := _cycles(_script_imports(f)))}
    assert cycles == {}
