"""docs/architecture.md names the code it describes; this fails when a name it gives no longer exists
(issue 38, item 6): a file or directory path, a type, or a function or method (``Type::method``,
``Type.method``, ``module.function``). Names of other projects (vLLM's, Rust's) are listed here."""

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
def code_text() -> str:
    return "\n".join(path.read_text(errors="replace") for glob in _CODE_GLOBS for path in REPO.glob(glob))


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


def names_in(document: Path) -> set[str]:
    return set(re.findall(r"`([^`\s]+)`", document.read_text()))


def problems_of(name: str) -> list[str]:
    if name.startswith(("-", "/", "$", "kvtier:")) or name in EXTERNAL:
        return []
    if "/" in name and re.fullmatch(r"[\w.\-/]+", name):
        path = name.rstrip("/").split("::")[0]
        if "/" not in path:
            return []  # one directory's name ("data/"): too common a word to resolve
        candidates = [REPO / path, REPO / "crates" / "kvtier-core" / "src" / path, REPO / "python" / "kvtier" / path]
        if VLLM_PACKAGE is not None:
            candidates.append(VLLM_PACKAGE.parent / path)
        if any(candidate.exists() or candidate.with_suffix(".rs").exists() for candidate in candidates):
            return []
        return [f"path {name} does not exist"]
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
    return [f"{name}: {part} is not defined in the code" for part in parts[modules:] if not defined(part)]


def test_every_name_docs_architecture_gives_exists():
    problems = [problem for document in DOCS for name in sorted(names_in(document)) for problem in problems_of(name)]
    assert not problems, "docs/architecture.md names what the code no longer has:\n" + "\n".join(problems)


def test_the_check_finds_a_renamed_function_and_a_moved_file():
    assert problems_of("RemoteTiers::contains") == []
    assert problems_of("RemoteTiers::contained_in_no_tier")
    assert problems_of("crates/kvtier-core/src/no_such_module.rs")
    assert problems_of("NoSuchTypeAnywhere")
