"""The package kvtier.bench.ttft imports one way: each module imports only modules before it in
LAYERS (the plan first, the entry point last), so that no import cycle creeps in and each module
reads with what comes before it. Reads the source (ast), imports nothing: no engine, under a second."""

from __future__ import annotations

import ast
from pathlib import Path

import kvtier.bench.ttft

PACKAGE = "kvtier.bench.ttft"
LAYERS = ("plan", "prompts", "engine", "engine_phase", "orchestrate", "report", "slow_rows", "entry")
PACKAGE_DIR = Path(kvtier.bench.ttft.__file__).parent


def package_modules_imported(path: Path) -> set[str]:
    """The modules of the package that ``path`` imports (absolute or relative imports)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:  # from .plan import x, from . import plan
            names = [node.module] if node.module else [alias.name for alias in node.names]
            names = [f"{PACKAGE}.{name}" for name in names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        imported |= {name.split(".")[3] for name in names if name.startswith(PACKAGE + ".")}
    return imported & set(LAYERS)


def test_every_module_of_the_package_has_a_layer() -> None:
    modules = {path.stem for path in PACKAGE_DIR.glob("*.py")} - {"__init__", "__main__"}
    assert modules == set(LAYERS), "add a new module of kvtier.bench.ttft to LAYERS, after what it imports"


def test_each_module_imports_only_the_modules_before_it() -> None:
    for index, module in enumerate(LAYERS):
        later = package_modules_imported(PACKAGE_DIR / f"{module}.py") - set(LAYERS[:index])
        assert not later, f"{PACKAGE}.{module} imports {sorted(later)}, which come after it (or itself) in LAYERS"


def test_the_checker_sees_a_backward_import(tmp_path: Path) -> None:
    source = tmp_path / "plan.py"
    source.write_text(
        f"from {PACKAGE}.report import markdown_table\nfrom . import entry\nimport {PACKAGE}.orchestrate\n"
    )
    assert package_modules_imported(source) == {"report", "entry", "orchestrate"}
