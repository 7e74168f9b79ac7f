"""The option tables of the docs, generated from the core's one option table (``kvtier.options()``).

``docs/configuration.md`` and ``docs/shared-tier.md`` hold the tables between marker comments; this
module renders them and rewrites or checks those blocks::

    python -m kvtier.option_docs            # print the tables
    python -m kvtier.option_docs --write    # rewrite the blocks in docs/
    python -m kvtier.option_docs --check    # exit 1 if a block differs (tests/test_options.py does this too)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtier import options

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"

# Block name -> the docs file holding it.
BLOCKS = {
    "store": "configuration.md",
    "shared": "configuration.md",
    "bucket": "configuration.md",
    "shared-tier": "shared-tier.md",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(block: str) -> list[dict]:
    if block == "store":
        return [o for o in options() if not o["name"].startswith(("shared_", "bucket_"))]
    if block == "bucket":
        return [o for o in options() if o["name"].startswith("bucket_")]
    if block == "shared":
        return [o for o in options() if o["name"].startswith("shared_")]
    if block == "shared-tier":
        return [o for o in options(include_rust_only=True) if o["name"].startswith("shared_")]
    raise ValueError(f"unknown block {block!r}; one of {', '.join(BLOCKS)}")


def _constraint(option: dict) -> str:
    choices = ", ".join(f'`"{c}"`' for c in option["choices"])
    return "; ".join(part for part in (choices, option["constraint"]) if part)


def render_block(block: str) -> str:
    """The markdown table of one block (no trailing newline)."""
    if block == "shared-tier":
        lines = ["| option (Python / Rust `SharedConfig`) | default | constraint | meaning |", "|---|---|---|---|"]
        for o in _rows(block):
            rust = "`" + o["field"].removeprefix("shared.") + "`"
            name = f"`{o['name']}` / {rust}" if o["python"] else f"Rust only: {rust}"
            lines.append(
                f"| {name} | {_cell(o['default_text'])} | {_cell(_constraint(o))} | {_cell(o['description'])} |"
            )
        return "\n".join(lines)
    lines = ["| option | default | constraints | what it does |", "| --- | --- | --- | --- |"]
    for o in _rows(block):
        lines.append(
            f"| `{o['name']}` | {_cell(o['default_text'])} | {_cell(_constraint(o))} | {_cell(o['description'])} |"
        )
    return "\n".join(lines)


def _begin(block: str) -> str:
    how = "generated from kvtier.options() by `python -m kvtier.option_docs --write`; do not edit"
    return f"<!-- options:{block} begin: {how} -->"


def _end(block: str) -> str:
    return f"<!-- options:{block} end -->"


def read_block(text: str, block: str) -> str | None:
    """The table between the block's markers in ``text`` (None when the markers are missing)."""
    begin, end = text.find(_begin(block)), text.find(_end(block))
    if begin < 0 or end < begin:
        return None
    return text[begin + len(_begin(block)) : end].strip("\n")


def update(text: str, block: str) -> str:
    """``text`` with the block's table regenerated (the markers must be there)."""
    begin, end = text.find(_begin(block)), text.find(_end(block))
    if begin < 0 or end < begin:
        raise ValueError(f"markers of block {block!r} not found; add {_begin(block)!r} and {_end(block)!r}")
    return text[: begin + len(_begin(block))] + "\n" + render_block(block) + "\n" + text[end:]


def stale_blocks(docs_dir: Path = DOCS_DIR) -> list[str]:
    """Blocks whose table in the docs differs from the generated one (or whose markers are missing)."""
    stale = []
    for block, name in BLOCKS.items():
        if read_block((docs_dir / name).read_text(), block) != render_block(block):
            stale.append(f"{name}:{block}")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.option_docs", description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=Path, default=DOCS_DIR, help="the docs directory (default: %(default)s)")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="rewrite the generated tables in the docs")
    action.add_argument("--check", action="store_true", help="exit 1 when a generated table in the docs is stale")
    args = parser.parse_args(argv)
    if args.write:
        for name in sorted(set(BLOCKS.values())):
            path = args.docs / name
            text = path.read_text()
            for block in (b for b, n in BLOCKS.items() if n == name):
                text = update(text, block)
            path.write_text(text)
        return 0
    if args.check:
        stale = stale_blocks(args.docs)
        if stale:
            print(f"stale option tables: {', '.join(stale)}; run python -m kvtier.option_docs --write", file=sys.stderr)
            return 1
        return 0
    for block in BLOCKS:
        print(f"{block}:\n{render_block(block)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
