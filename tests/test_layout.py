"""The shape of the house: layers that import only downward (imports inside functions count), Ray at one edge, no
import circles, functions that fit a screen, modules that fit a sitting, and comments that describe the code rather
than its history."""
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "raytrain_scu"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400

# the layers, lowest first: a module may import its own layer and the ones below. A name matches a module and
# everything under it; the most specific entry wins. Top-level modules not listed here are the documented
# `python -m raytrain_scu.<command>` entry points and the spec's public import paths: thin shims, the top layer.
LAYERS = [
    ("errors",),
    ("config",),  # schema, io, checks, law_keys, load, paths, secrets: pure
    ("core", "console", "plots"),
    ("hardware",),  # the cards, the presets, the memory estimator and the model's shape for it (read through core)
    ("tracking",),
    ("worker",),
    ("ray",),
    ("driver",),  # resolve.py among them: the CLIs' front door reads the cards and the model's config and family
    ("studies", "cli"),
]
SHIM_LAYER = len(LAYERS)


def modules() -> dict[str, Path]:
    """``{dotted name below raytrain_scu: path}``, packages by their ``__init__``."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def layer_of(name: str) -> int:
    if name.endswith("__main__"):  # `python -m raytrain_scu.<package>`: a shim over cli/
        return SHIM_LAYER
    if name == "":  # the package's own __init__: empty
        return 0
    best, rank = -1, SHIM_LAYER
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    return rank


def imports_of(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports, anywhere in the file (``from raytrain_scu.x import y`` counts x.y when
    that is a module, else x; an ``importlib.import_module`` or ``__import__`` of a literal name too), and the
    packages each of them sits in (whose ``__init__`` runs first)."""
    mods, found = modules(), set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and (
                getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) == "__import__"):
            name_ = str(node.args[0].value)
            targets = [name_.removeprefix("raytrain_scu").lstrip(".")] if name_.startswith("raytrain_scu") else []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
                if not module.startswith("raytrain_scu"):
                    continue
                module = module.removeprefix("raytrain_scu").lstrip(".")
            targets = [f"{module}.{a.name}".strip(".") if f"{module}.{a.name}".strip(".") in mods else module
                       for a in node.names]
        for t in targets:
            t = t.removeprefix("raytrain_scu").lstrip(".") if isinstance(node, ast.Import) else t
            if isinstance(node, ast.Import) and not node.names[0].name.startswith("raytrain_scu"):
                continue
            if t in mods and t != name:
                found.add(t)
            # importing x.y runs package x's __init__ first: an edge to x too
            parents = (".".join(t.split(".")[:k]) for k in range(1, t.count(".") + 1))
            found |= {p for p in parents if p in mods and p != name}
    return found


def graph() -> dict[str, set[str]]:
    return {name: imports_of(name, path) for name, path in modules().items()}


def test_imports_run_only_downward():
    upward = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
              for a, targets in graph().items() for b in targets if layer_of(b) > layer_of(a)]
    assert not upward, upward


def test_core_and_worker_never_import_driver_cli_or_studies():
    bad = [f"{a} imports {b}" for a, targets in graph().items() if a.split(".")[0] in ("core", "worker")
           for b in targets if b.split(".")[0] in ("driver", "cli", "studies")]
    assert not bad, bad


def test_the_import_graph_has_no_cycles():
    g, state, cycles = graph(), {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(g[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_config_imports_nothing_above_its_floor(tmp_path):
    """config/ is the pure floor the others build on: every import of the package in it, inside a function or through
    importlib too, names config itself or errors (the front door, which reads the cards and the model, is
    driver/resolve.py). ``config/__main__.py`` is the ``python -m raytrain_scu.config`` shim over cli/, the top floor."""
    sample = tmp_path / "x.py"
    sample.write_text("import os\ndef f():\n    from raytrain_scu.core.model import families\n    import raytrain_scu.ray\n"
                      "    return importlib.import_module('raytrain_scu.driver.resolve')\nfrom . import schema\n")
    assert {"core.model.families", "ray", "driver.resolve", "config.schema"} <= imports_of("config.x", sample)
    g = graph()
    assert "config.schema" in g["config.load"]  # the graph is config's real one
    above = [f"{a} imports {b}" for a, targets in g.items()
             if a.split(".")[0] == "config" and not a.endswith("__main__")
             for b in targets if b.split(".")[0] not in ("config", "errors")]
    assert not above, above


IMPORTS_RAY = re.compile(r"^\s*(import ray\b|from ray(\.| import))", re.MULTILINE)


def test_ray_is_imported_only_under_ray():
    importing = sorted(n for n, p in modules().items() if IMPORTS_RAY.search(p.read_text()))
    assert importing and all(n == "ray" or n.startswith("ray.") for n in importing), importing


def test_no_function_is_longer_than_60_lines():
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_no_module_is_longer_than_400_lines():
    long = [f"{n} ({k} lines)" for n, p in modules().items() if (k := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, long


HISTORY = re.compile(r"#\d{1,3}\b|\bissues?\s+#?\d|\b20\d\d-\d\d(-\d\d)?\b")


def test_no_comment_names_an_issue_or_a_date():
    found = []
    for name, path in modules().items():
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.COMMENT and HISTORY.search(tok.string):
                found.append(f"{name}:{tok.start[0]} {tok.string.strip()}")
    assert not found, found


def test_the_layout_checks_see_the_real_graph():
    """The checks above would pass on an empty graph: this one pins a few arrows that exist."""
    g = graph()
    assert "config.schema" in g["config.load"] and "ray.launch" in g["driver.run"]
    assert layer_of("driver.resolve") > layer_of("hardware.shape") > layer_of("core.model") > layer_of("config.schema")
    assert "core.model.families" in g["hardware.shape"] and "hardware.shape" in g["driver.resolve"]
    assert layer_of("train") == SHIM_LAYER and layer_of("ray.tune.sweep") == layer_of("ray")


def test_cluster_and_experiments_hold_launcher_files_and_configs_only():
    """cluster/ holds the cluster launcher files and the node script, experiments/ the run configs: a script that
    measures or builds something lives in tools/ (or tests/, where it is a test)."""
    scripts = sorted(str(p.relative_to(ROOT)) for d in ("cluster", "experiments") for p in (ROOT / d).rglob("*.py"))
    assert not scripts, f"{scripts}: move them to tools/"
    allowed = {"cluster": lambda p: p.suffix == ".yaml" or p.name == "node.sh",
               "experiments": lambda p: p.suffix == ".yaml"}
    other = sorted(str(p.relative_to(ROOT)) for d, ok in allowed.items() for p in (ROOT / d).iterdir()
                   if not p.name.startswith(".") and not (p.is_file() and ok(p)))
    assert not other, f"{other}: move them to tools/"


@pytest.mark.slow
def test_what_a_train_controller_and_a_trial_import_leaves_the_worker_stack_out():
    """A Train controller unpickles ray.callbacks before it starts any worker, and a sweep trial's actor imports
    ray.tune.sweep to build its trainer: neither imports transformers, peft or bitsandbytes (seconds per process,
    paid at every run's and every trial's start). The controller's module leaves torch out too."""
    import json
    import subprocess
    import sys

    heavy = ("torch", "transformers", "peft", "bitsandbytes")
    for module, allowed in (("raytrain_scu.ray.callbacks", ()), ("raytrain_scu.ray.tune.sweep", ("torch",))):
        code = f"import json, sys, {module}; print(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert set(json.loads(out.stdout.splitlines()[-1])) <= set(allowed), (module, out.stdout)
