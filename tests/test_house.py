"""The house stays easy to extend: measured limits on the code's shape (issue: the redesign).

No import cycles between project modules; a pipeline stage imports only the stages before it
(``STAGES``: docs/architecture.md's order); project modules imported at module level (function-level
imports are for heavy optional dependencies -- Ray, MLflow, Optuna, matplotlib, sklearn -- and for
the CLI's start-up time); no function over 120 lines or with more than 12 parameters; no module
over 600 lines.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("twin", "lora_opt")
MAX_FUNCTION_LINES = 120
MAX_PARAMETERS = 12
MAX_MODULE_LINES = 600
# modules whose function-level project imports keep start-up fast (one command imports only its own code)
LAZY_IMPORTERS = ("lora_opt.cli",)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
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
     "lora_opt.tracking"),
    ("lora_opt.calibration",),
    ("lora_opt.surrogates",),
    ("lora_opt.placement",),
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
