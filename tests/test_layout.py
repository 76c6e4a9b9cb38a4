"""The house's size limits (issue #15): every function fits a screen, every module a sitting, and Ray stays at the
edge (launch, the sweep's Tune module, the environment check, and at most one more)."""
import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "raytrain_scu"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 550
MAX_RAY_MODULES = 4
IMPORTS_RAY = re.compile(r"^\s*(import ray\b|from ray(\.| import))", re.MULTILINE)


def modules():
    return sorted(PACKAGE.glob("*.py"))


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_no_module_is_longer_than_550_lines():
    long = [f"{p.name} ({n} lines)" for p in modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, long


def test_at_most_four_modules_import_ray():
    importing = [p.name for p in modules() if IMPORTS_RAY.search(p.read_text())]
    assert "launch.py" in importing and len(importing) <= MAX_RAY_MODULES, importing
    for clean in ("checkpoint.py", "tracking.py", "evaluate.py", "bench.py", "loop.py", "train.py", "model.py",
                  "data.py", "controller.py", "config.py"):
        assert clean not in importing, clean
