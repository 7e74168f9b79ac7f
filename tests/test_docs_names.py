"""docs/architecture.md names the code it describes; this fails when a name it gives no longer exists
(issue 38, item 6): a file or directory path, a type, or a function or method (``Type::method``,
``Type.method``, ``module.function``). Names of other projects (vLLM's, Rust's) are listed here.

A member is looked for where its owner is, not anywhere: ``Type::method`` in the files that declare
or implement the Rust type ``Type`` or in the body of the Python class ``Type``, ``module::function``
in the Rust module's files (``mover::reserve_puts`` in ``mover.rs`` or ``mover/``), ``module.name`` in
the Python module's file, ``path.rs::function`` in that file. So a method that moved to another type
fails, as one renamed does. An owner it cannot find (a crate, a package, vLLM's) leaves the member to
the name check alone; a method a Python class inherits counts as missing from it."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "docs" / "architecture.md"]
# Names the documents use that are not kvtier's: vLLM's, Python's, Rust's, the OS's.
EXTERNAL = {
    "LLM", "OffloadingConnector", "OffloadingManager", "OffloadingWorker", "OffloadingSpec", "Drop", "None",
    "True", "False", "Arc", "Mutex", "Condvar", "Vec", "Option", "Result", "HashMap", "LoadStoreSpec",
    "LookupResult", "SchedulerOutput", "TransferResult", "ReqContext", "OffloadingEvent", "KVConnectorBase_V1",
}  # fmt: skip
_CODE_GLOBS = ("crates/**/*.rs", "python/**/*.py", "scripts/**/*.sh", "scripts/**/*.py")


@cache
def sources() -> dict[Path, str]:
    return {path: path.read_text(errors="replace") for glob in _CODE_GLOBS for path in REPO.glob(glob)}


@cache
def code_text() -> str:
    return "\n".join(sources().values())


VLLM_PACKAGE = (
    next((REPO / ".venv" / "lib").glob("python3*/site-packages/vllm"), None) if (REPO / ".venv").exists() else None
)


@cache
def file_named(name: str) -> bool:
    """A file of kvtier's (or vLLM's, for the names of its files the documents give) named ``name``."""
    if any(REPO.glob(f"crates/**/{name}")) or any(REPO.glob(f"python/**/{name}")) or any(REPO.glob(f"*/{name}")):
        return True
    return VLLM_PACKAGE is not None and any(VLLM_PACKAGE.glob(f"**/{name}"))


@cache
def python_module(dotted: str) -> bool:
    """``kvtier.x.y`` or a module's own name (``local_store``) is a module file of the package."""
    if dotted in ("kvtier", "kvtier._core"):  # the package, and its Rust extension (crates/kvtier-py)
        return True
    parts = dotted.removeprefix("kvtier.").split(".") if dotted.startswith("kvtier.") else [dotted]
    base = REPO / "python" / "kvtier"
    if dotted.startswith("kvtier."):
        return (base.joinpath(*parts).with_suffix(".py")).exists() or (base.joinpath(*parts) / "__init__.py").exists()
    return any(base.glob(f"**/{dotted}.py"))


@cache
def defined(name: str) -> bool:
    """``name`` is defined in kvtier's code: a Rust fn, struct, enum, trait, type, const or enum
    variant, a Python def, class or module-level name."""
    text = code_text()
    pattern = rf"\b(fn|struct|enum|trait|type|const|static|def|class|mod)\s+{re.escape(name)}\b"
    if re.search(pattern, text) or re.search(rf'#\[pyclass\(name = "{re.escape(name)}"', text):
        return True
    # An enum variant (`Op::Acquire`), a field, or a Python name assigned at module level.
    return bool(re.search(rf"^\s*{re.escape(name)}\s*[,({{=:]", text, re.MULTILINE))


def declares(text: str, member: str) -> bool:
    """``text`` declares ``member``: a fn, def, type or const of that name, a field or an enum
    variant (``name: T``, ``Name(T)``, ``Name = 3,``), or an attribute (``self.name = ...``)."""
    m = re.escape(member)
    return bool(
        re.search(rf"\b(fn|def|struct|enum|trait|type|const|static|class)\s+{m}\b", text)
        or re.search(rf"^\s*(pub(\([\w:]+\))?\s+)?{m}\s*[,({{=:]", text, re.MULTILINE)
        or re.search(rf"\bself\.{m}\s*[:=]", text)
    )


@cache
def types() -> dict[str, tuple[str, ...]]:
    """Each type of the code -> its code: the Rust files that declare or implement it (its impl
    blocks may be spread over several; a ``#[pyclass(name = ...)]`` binds a Python name to one), and
    the body of a Python class. One pass over the sources, so that looking owners up stays cheap."""
    found: dict[str, list[str]] = {}
    for path, text in sources().items():
        if path.suffix == ".rs":
            names = set(re.findall(r"\b(?:struct|enum|trait|union)\s+(\w+)", text))
            names |= set(re.findall(r'#\[pyclass\(name = "(\w+)"', text))
            for header in re.findall(r"\bimpl\b([^{;]*)\{", text):
                # `impl<T> Trait for Owner<T>`: its names, not those of a path (`std::ops::Deref`).
                names |= set(re.findall(r"(?<![\w:])(\w+)(?![\w:])", header))
            for name in names:
                found.setdefault(name, []).append(text)
        elif path.suffix == ".py":
            for body in re.finditer(r"^class\s+(\w+).*?(?=^\S|\Z)", text, re.M | re.S):
                found.setdefault(body.group(1), []).append(body.group(0))
    return {name: tuple(texts) for name, texts in found.items()}


@cache
def owner_texts(owner: str) -> tuple[str, ...]:
    """The code of ``owner``: a type's (``types``), or else the files of a Rust module or the
    Python module file of that name. Empty when it is none of these."""
    if owner in types() or not owner[:1].islower():
        return types().get(owner, ())
    texts = []
    for path, text in sources().items():
        under_src = path.parts[path.parts.index("src") + 1 :] if path.suffix == ".rs" and "src" in path.parts else ()
        if under_src and (owner in under_src[:-1] or under_src[-1] == f"{owner}.rs"):
            texts.append(text)  # a Rust module: owner.rs, or a file under owner/
        elif path.suffix == ".py" and path.name == f"{owner}.py" and "python" in path.parts:
            texts.append(text)  # a Python module (a package's __init__ re-exports: not looked into)
    return tuple(texts)


def membership_problems(name: str, parts: list[str]) -> list[str]:
    """``Owner::member`` or ``Owner.member`` (the last two parts of ``name``): ``member`` where
    ``owner`` is, when ``owner`` is found."""
    if len(parts) < 2:
        return []
    owner, member = parts[-2], parts[-1]
    texts = owner_texts(owner)
    if not texts or any(declares(text, member) for text in texts):
        return []
    return [f"{name}: {owner} has no {member}"]


def resolved_path(path: str) -> Path | None:
    """A path the document gives, from the repository, the Rust core's ``src/``, the Python package
    (or vLLM's package, for its files the document names)."""
    candidates = [REPO / path, REPO / "crates" / "kvtier-core" / "src" / path, REPO / "python" / "kvtier" / path]
    if VLLM_PACKAGE is not None:
        candidates.append(VLLM_PACKAGE.parent / path)
    for candidate in candidates:
        for found in (candidate, candidate.with_suffix(".rs")):
            if found.exists():
                return found
    return None


def names_in(document: Path) -> set[str]:
    return set(re.findall(r"`([^`\s]+)`", document.read_text()))


def problems_of(name: str) -> list[str]:
    if name.startswith(("-", "/", "$", "kvtier:")) or name in EXTERNAL:
        return []
    if "/" in name and re.fullmatch(r"[\w.\-/]+", name):
        path = name.rstrip("/").split("::")[0]
        if "/" not in path:
            return []  # one directory's name ("data/"): too common a word to resolve
        return [] if resolved_path(path) is not None else [f"path {name} does not exist"]
    if in_file := re.fullmatch(r"([\w.\-/]+\.rs)::(\w+)", name):  # `tiers/nvme.rs::recover`
        path, function = in_file.groups()
        found = resolved_path(path)
        if found is None:
            return [f"path {path} does not exist"]
        return [] if declares(found.read_text(), function) else [f"{name}: {path} has no {function}"]
    if re.fullmatch(r"[\w\-]+\.(rs|py|md|sh|toml|json)", name):
        return [] if file_named(name) else [f"file {name} does not exist"]
    parts = [part for part in re.split(r"::|\.", name) if part]
    if not parts or not all(re.fullmatch(r"[A-Za-z_]\w*", part) for part in parts):
        return []  # not a code name (a size, a flag value, a file mode)
    if len(parts) == 1 and not parts[0][:1].isupper():
        return []  # a lower-case word alone: an option or a value, checked by the option tests
    if parts[0] in EXTERNAL:
        return []
    modules = next((i for i in range(len(parts), 0, -1) if python_module(".".join(parts[:i]))), 0)
    if modules == 0 and parts[0] == "kvtier":
        return [f"{name}: no such module"]
    undefined = [f"{name}: {part} is not defined in the code" for part in parts[modules:] if not defined(part)]
    if undefined or modules == len(parts):
        return undefined  # a module in full (`kvtier.ops.metrics`) is checked as one
    return membership_problems(name, parts)


def test_every_name_docs_architecture_gives_exists():
    problems = [problem for document in DOCS for name in sorted(names_in(document)) for problem in problems_of(name)]
    assert not problems, "docs/architecture.md names what the code no longer has:\n" + "\n".join(problems)


def test_the_check_finds_a_renamed_function_and_a_moved_file():
    assert problems_of("RemoteTiers::contains") == []
    assert problems_of("RemoteTiers::contained_in_no_tier")
    assert problems_of("crates/kvtier-core/src/no_such_module.rs")
    assert problems_of("NoSuchTypeAnywhere")


def test_the_check_finds_a_member_named_on_the_wrong_owner():
    # Each member exists, but not where these names put it.
    assert problems_of("Regions::reclaim_oldest") == []
    assert problems_of("Catalog::reclaim_oldest")  # it is `Regions`'
    assert problems_of("mover::reserve_puts") == [] and problems_of("catalog::reserve_puts")
    assert problems_of("KvtierManager.prepare_load") == [] and problems_of("ServiceConnection.prepare_load")
    assert problems_of("ServiceClient.set_placement") == []  # the binding's class (`#[pyclass(name = ...)]`)
    assert problems_of("GetStep::Nvme") == [] and problems_of("StoreConfig::fault_plan") == []  # variant, field
    assert problems_of("tiers/nvme.rs::recover") == []
    assert problems_of("tiers/nvme.rs::plan_put")  # the catalog's
    assert problems_of("tiers/no_such_file.rs::recover")


CORE_SRC = REPO / "crates" / "kvtier-core" / "src"


def core_nodes() -> set[str]:
    """The Rust core's module nodes as `tidy.rs` draws them: each file directly under ``src/`` and each
    directory there, but for the root (``lib.rs``), the binaries (``bin/``) and test files."""
    nodes = {path.stem for path in CORE_SRC.glob("*.rs") if not path.stem.endswith("_tests")}
    nodes |= {path.name for path in CORE_SRC.iterdir() if path.is_dir()}
    return nodes - {"lib", "bin"}


def layer_rows(text: str) -> dict[str, tuple[int, str]]:
    """The layer drawing of "Code layout": node -> (its row, the row's note in parentheses)."""
    drawing = text.split("These are today's nodes by layer", 1)[1].split("```", 2)[1]
    rows: dict[str, tuple[int, str]] = {}
    for line in drawing.splitlines():
        if match := re.match(r"\s*(\d+)\s+([\w\s]+?)\s*(\(.*\))?$", line):
            for node in match.group(2).split():
                rows[node] = (int(match.group(1)), match.group(3) or "")
    return rows


def edge_table(text: str) -> dict[str, set[str]]:
    """The table after "The edges themselves": node -> the nodes it uses."""
    table = text.split("The edges themselves", 1)[1].split("\n\n", 2)[1]
    edges: dict[str, set[str]] = {}
    for line in table.splitlines()[2:]:
        users, used = line.strip("|").split("|")
        for node in re.findall(r"`(\w+)`", users):
            edges[node] = set(re.findall(r"`(\w+)`", used))
    return edges


def layer_problems(text: str, nodes: set[str]) -> list[str]:
    rows, edges = layer_rows(text), edge_table(text)
    problems = [f"module {node} is in no row of the layer drawing" for node in sorted(nodes - rows.keys())]
    problems += [f"the layer drawing's {node} is no module of the core" for node in sorted(rows.keys() - nodes)]
    problems += [f"module {node} is in no row of the edge table" for node in sorted(nodes - edges.keys())]
    problems += [f"the edge table's {node} is no module of the core" for node in sorted(edges.keys() - nodes)]
    for node, used in sorted(edges.items()):
        problems += [f"the edge table's {node} uses {target}, no module" for target in sorted(used - nodes)]
        problems += [
            f"{node} (row {rows[node][0]}) uses {target} (row {rows[target][0]}): not a lower row"
            for target in sorted(used & rows.keys())
            if node in rows and rows[target][0] >= rows[node][0]
        ]
    for node, (_, note) in sorted(rows.items()):
        problems += note_problems(node, note)
    return problems


def note_problems(node: str, note: str) -> list[str]:
    """A directory node's note in the drawing (``(service/: protocol, server, ...)``) against what
    is in the directory: every child module is named in it, and every item of its list is a child."""
    listed = re.match(rf"\({node}/: (.*)\)$", note)
    if listed is None or not (CORE_SRC / node).is_dir():
        return []
    children = {path.stem for path in (CORE_SRC / node).glob("*.rs")} - {"mod"}
    children |= {path.name for path in (CORE_SRC / node).iterdir() if path.is_dir()}
    problems = [
        f"{node}/{child} is not in {node}'s note" for child in sorted(children) if not re.search(rf"\b{child}\b", note)
    ]
    items = [item.strip().rstrip("/") for item in re.split(r"[,;]", listed.group(1))]
    return problems + [
        f"{node}'s note names {item}, not in {node}/"
        for item in items
        if re.fullmatch(r"\w+", item) and item not in children
    ]


def test_the_layer_drawing_and_edge_table_name_the_core_modules_as_they_are():
    """The drawing and the table of "Code layout" name every module node of the core and no other, each
    table edge goes down the drawing, and a directory's note names what is in it. The edges themselves
    are `tidy.rs`'s to find (it parses the Rust); what changes them is seen there."""
    problems = layer_problems(DOCS[0].read_text(), core_nodes())
    assert not problems, "docs/architecture.md's layers do not match crates/kvtier-core/src:\n" + "\n".join(problems)


def test_the_layer_check_finds_a_new_module_a_gone_one_and_an_upward_edge():
    text, nodes = DOCS[0].read_text(), core_nodes()
    assert "catalog" in nodes and "bin" not in nodes and "catalog_model_tests" not in nodes
    assert any("module planted is in no row" in p for p in layer_problems(text, nodes | {"planted"}))
    assert any("drawing's admission is no module" in p for p in layer_problems(text, nodes - {"admission"}))
    upward = text.replace("| `admission` | `key` |", "| `admission` | `key`, `store` |")
    stale = text.replace("(service/: protocol, ", "(service/: protocol, planted, ")
    unlisted = text.replace(", socket_file)", ")")
    assert text not in (upward, stale, unlisted), "the document changed: plant these elsewhere"
    assert any("admission (row 1) uses store (row 8)" in p for p in layer_problems(upward, nodes))
    assert any("names planted, not in service/" in p for p in layer_problems(stale, nodes))
    assert any("service/socket_file is not in" in p for p in layer_problems(unlisted, nodes))
