"""Python's half of the tidy test (crates/kvtier-core/tests/tidy.rs is the Rust half).

- **One-way imports.** The modules of the ``kvtier`` package import each other one way. Every import
  counts: one inside a function (made late on purpose, it still ties the two modules together), and
  one under ``if TYPE_CHECKING`` (no cycle at run time, but a reader still needs each module to read
  the other).
- **kvtier.vllm's layers.** Its ``__init__``'s docstring lists its modules in numbered layers, lowest
  first; every module is listed, and each imports only modules of lower layers.
- **No test seams in kvtier.vllm's public names.** What the private ``kvtier.vllm._testing`` offers
  tests and benchmarks is neither imported by the package's ``__init__`` nor defined or imported by
  any of its public modules (their registries stay private: ``_``-named).
- **Short functions.** No function or method of the package is longer than ``MAX_FUNCTION_LINES``,
  from its ``def`` (decorators left out) to its last line, unless it is on ``LONG_FUNCTIONS``; an
  entry there that fits again fails too, so that the list only shrinks.
- **Short files.** No ``.py`` file of the package is longer than ``MAX_FILE_LINES`` lines (issue 38:
  a module past it is split along its seams into modules named for what they hold).
- **One list of tiers.** No module spells out the tiers below DRAM in a literal (a tuple, list, set
  or dict's keys naming two remote tiers): tier lists derive from ``kvtier.tiers``, the core's table,
  so that a tier the core adds reaches every list (issue 38).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "kvtier"
MAX_FUNCTION_LINES = 70
MAX_FILE_LINES = 800

# Functions allowed over the limit, as (file under python/kvtier, qualified name): their length when
# listed. The fifteen listed when this check came (2026-11-27) are all shortened; never add one.
LONG_FUNCTIONS: dict[tuple[str, str], int] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
            else:
                for field in ("body", "orelse", "finalbody"):
                    visit([child for child in getattr(node, field, None) or [] if isinstance(child, ast.stmt)])
                for handler in getattr(node, "handlers", None) or []:
                    visit(handler.body)

    visit(tree.body)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        imports = imports_of(ast.parse(path.read_text()), name, path.name == "__init__.py")
        graph[name] = {target for target in imports if target in files and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_kvtier_package_has_no_import_cycle():
    graph = import_graph()
    assert "kvtier.vllm.spec" in graph and "kvtier.service" in graph["kvtier.service_main"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checker_finds_a_planted_cycle():
    graph = import_graph()
    graph["kvtier.service"] = graph["kvtier.service"] | {"kvtier.ops.metrics"}
    assert find_cycle(graph) is not None


def test_the_checker_counts_an_import_for_type_checking_only():
    # The circle kvtier.vllm once had: the connection named the worker for its annotations only.
    source = "import typing\n\nif typing.TYPE_CHECKING:\n    from kvtier.vllm.worker import JobQueueWorker\n"
    planted = imports_of(ast.parse(source), "kvtier.vllm.connection", is_package=False)
    assert "kvtier.vllm.worker" in planted
    graph = import_graph()
    graph["kvtier.vllm.connection"] = graph["kvtier.vllm.connection"] | (planted & graph.keys())
    cycle = find_cycle(graph)
    assert cycle is not None and "kvtier.vllm.connection" in cycle and "kvtier.vllm.worker" in cycle


def documented_layers() -> dict[str, int]:
    """kvtier.vllm's modules -> their layer, from the numbered list in its ``__init__``'s docstring
    (``N. ``module``, ``module``: what they hold``)."""
    docstring = ast.get_docstring(ast.parse((PACKAGE / "vllm" / "__init__.py").read_text())) or ""
    layers: dict[str, int] = {}
    for line in docstring.splitlines():
        if match := re.match(r"(\d+)\. ([^:]*):", line):
            for module in re.findall(r"``(\w+)``", match.group(2)):
                layers[f"kvtier.vllm.{module}"] = int(match.group(1))
    return layers


def layer_problems(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    modules = {name for name in graph if name.startswith("kvtier.vllm.")}
    problems = [f"{name} is in no layer of kvtier/vllm/__init__.py's list" for name in sorted(modules - layers.keys())]
    problems += [f"{name} is in the layers and is no module" for name in sorted(layers.keys() - modules)]
    for name in sorted(modules & layers.keys()):
        problems += [
            f"{name} (layer {layers[name]}) imports {target} (layer {layers[target]}): only lower layers"
            for target in sorted(graph[name])
            if target in layers and layers[target] >= layers[name]
        ]
    return problems


def test_kvtier_vllm_imports_only_down_its_documented_layers():
    layers = documented_layers()
    assert layers["kvtier.vllm.options"] == 1 and layers["kvtier.vllm.connector"] > layers["kvtier.vllm.spec"]
    problems = layer_problems(import_graph(), layers)
    assert not problems, "\n".join(problems)


def test_the_layer_check_finds_an_upward_import_and_an_unlisted_module():
    graph, layers = import_graph(), documented_layers()
    upward = {**graph, "kvtier.vllm.options": graph["kvtier.vllm.options"] | {"kvtier.vllm.manager"}}
    assert any("kvtier.vllm.options (layer 1) imports kvtier.vllm.manager" in p for p in layer_problems(upward, layers))
    unlisted = {**graph, "kvtier.vllm.planted": set()}
    assert any("kvtier.vllm.planted is in no layer" in p for p in layer_problems(unlisted, layers))


def test_kvtier_vllm_exports_no_test_seam():
    def names_of(tree: ast.Module) -> set[str]:
        """The names a module defines or imports at its top level, and those its ``__all__`` lists."""
        names: set[str] = set()
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.Tuple)):
                names.update(
                    element.value
                    for element in node.value.elts
                    if isinstance(element, ast.Constant) and isinstance(element.value, str)
                )
        return names

    seams = {
        node.name
        for node in ast.parse((PACKAGE / "vllm" / "_testing.py").read_text()).body
        if isinstance(node, ast.FunctionDef)
    }
    assert {"service_connections", "open_stores", "wait_for_stores"} <= seams
    public = {
        path.name: names_of(ast.parse(path.read_text()))
        for path in sorted((PACKAGE / "vllm").glob("*.py"))
        if not path.name.startswith("_") or path.name == "__init__.py"
    }
    assert "KvtierConnector" in public["__init__.py"] and "JobQueueWorker" in public["worker.py"]
    leaks = [f"kvtier/vllm/{file}: {sorted(seams & names)}" for file, names in public.items() if seams & names]
    assert not leaks, "test seams in kvtier.vllm's public modules:\n" + "\n".join(leaks)


def function_lengths() -> dict[tuple[str, str], int]:
    """(file under python/kvtier, qualified name) -> lines from ``def`` to the function's last line."""
    lengths: dict[tuple[str, str], int] = {}

    def visit(nodes: list[ast.stmt], file: str, prefix: str) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                lengths[(file, prefix + node.name)] = node.end_lineno - node.lineno + 1
                visit(node.body, file, f"{prefix}{node.name}.")
            elif isinstance(node, ast.ClassDef):
                visit(node.body, file, f"{prefix}{node.name}.")
            else:
                for field in ("body", "orelse", "finalbody"):
                    visit(
                        [child for child in getattr(node, field, None) or [] if isinstance(child, ast.stmt)],
                        file,
                        prefix,
                    )

    for path in sorted(PACKAGE.rglob("*.py")):
        visit(ast.parse(path.read_text()).body, path.relative_to(PACKAGE).as_posix(), "")
    return lengths


def long_function_problems(lengths: dict[tuple[str, str], int], allowed: dict[tuple[str, str], int]) -> list[str]:
    problems = [
        f"{file}: {name} is {lines} lines (at most {MAX_FUNCTION_LINES}): split it into named steps"
        for (file, name), lines in sorted(lengths.items())
        if lines > MAX_FUNCTION_LINES and (file, name) not in allowed
    ]
    for (file, name), was in sorted(allowed.items()):
        now = lengths.get((file, name))
        if now is None or now <= MAX_FUNCTION_LINES:
            problems.append(
                f"{file}: {name} ({was} lines when listed) is gone or fits now: remove it from LONG_FUNCTIONS"
            )
    return problems


def test_functions_fit_on_a_screen():
    problems = long_function_problems(function_lengths(), LONG_FUNCTIONS)
    assert not problems, "\n".join(problems)


def test_the_length_check_finds_a_new_long_function_and_a_stale_entry():
    lengths = function_lengths()
    assert lengths[("bench/serve.py", "main")] > 10  # qualified names as the list spells them
    planted = {**lengths, ("service.py", "planted"): MAX_FUNCTION_LINES + 1}
    assert any("planted" in problem for problem in long_function_problems(planted, LONG_FUNCTIONS))
    stale = {**LONG_FUNCTIONS, ("service.py", "ensure_service"): 99}
    assert any("ensure_service" in problem for problem in long_function_problems(lengths, stale))


def file_lengths() -> dict[str, int]:
    """File under python/kvtier -> its lines."""
    return {
        path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines())
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def long_file_problems(lengths: dict[str, int]) -> list[str]:
    return [
        f"{file} is {lines} lines (at most {MAX_FILE_LINES}): split it along its seams into modules of their own"
        for file, lines in sorted(lengths.items())
        if lines > MAX_FILE_LINES
    ]


def test_files_stay_short():
    problems = long_file_problems(file_lengths())
    assert not problems, "\n".join(problems)


def test_the_file_length_check_finds_a_planted_long_file():
    lengths = file_lengths()
    assert lengths["bench/serve.py"] > 10 and "bench/ttft/engine.py" in lengths  # paths as the problems spell them
    planted = {**lengths, "planted.py": MAX_FILE_LINES + 1}
    assert long_file_problems(planted) == [
        f"planted.py is {MAX_FILE_LINES + 1} lines (at most {MAX_FILE_LINES}): split it along its seams into "
        "modules of their own"
    ]
    assert not long_file_problems({**lengths, "planted.py": MAX_FILE_LINES})


# The remote tiers' names: a literal naming two of them is a list of tiers written out.
REMOTE_TIER_NAMES = frozenset({"shared", "bucket"})


def tier_list_literals(path: Path, root: Path = PACKAGE) -> list[str]:
    """Where ``path`` writes a list of tiers out: ``file:line`` (under ``root``) of each literal naming
    two remote tiers."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        elements = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or elements is None:
            continue
        names = {e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        if len(names & REMOTE_TIER_NAMES) >= 2:
            found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return found


def test_tier_lists_come_from_the_tier_table():
    literals = [at for path in sorted(PACKAGE.rglob("*.py")) for at in tier_list_literals(path)]
    # Not tier lists: the benchmarks' tables of their own figures per tier, and the option docs'
    # blocks (a tier's options get a block of the configuration docs as they get their table rows).
    problems = [at for at in literals if not at.startswith(("bench/", "option_docs.py:"))]
    assert not problems, f"tiers written out (derive them from kvtier.tiers): {problems}"


def test_the_tier_list_check_finds_a_written_out_list(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('TIERS = ("dram", "nvme", "shared", "bucket")\nLABELS = {"shared": 1, "bucket": 2}\n')
    assert tier_list_literals(planted, tmp_path) == ["planted.py:1", "planted.py:2"]
