"""The `kvtier` command line (also `python -m kvtier`).

This module owns only dispatch: each subcommand lives in its own module, with its own `main(argv)`,
imported when it is used so that one missing optional part never breaks the others.

    kvtier bench io [...]     the store against fio and LMCache (kvtier.bench.io)
    kvtier bench ttft [...]   time to first token through a real engine (kvtier.bench.ttft)
    kvtier bench lookup       host service round-trip latency (kvtier.bench.lookup)
    kvtier bench layout       TTFT across engines sharing the host service (kvtier.bench.layout)
    kvtier demo [...]         the end-to-end demo (kvtier.demo)
    kvtier serve PATH [...]   the host service that engines share (kvtier.service)
"""

from __future__ import annotations

import importlib
import sys

# (words, module, what it does)
SUBCOMMANDS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("bench", "io"), "kvtier.bench.io", "store and cold retrieve vs fio and LMCache's disk backend"),
    (("bench", "ttft"), "kvtier.bench.ttft", "time to first token through a real engine, with and without kvtier"),
    (("bench", "lookup"), "kvtier.bench.lookup", "round-trip latency of lookups and pins through the host service"),
    (("bench", "layout"), "kvtier.bench.layout", "TTFT in vLLM's default layout: same- and cross-engine hits, TP=2"),
    (("demo",), "kvtier.demo", "end-to-end demo with a real engine"),
    (("serve",), "kvtier.service", "run the host service for a store path (engines start one when none runs)"),
)

EXIT_USAGE = 2


def usage() -> str:
    lines = ["usage: kvtier <command> [options]", "", "commands:"]
    for words, _module, summary in SUBCOMMANDS:
        lines.append(f"  {' '.join(words):<12} {summary}")
    lines.append("")
    lines.append("Run `kvtier <command> --help` for the options of one command.")
    return "\n".join(lines)


def _load_main(module_name: str, words: tuple[str, ...]):
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and (module_name == error.name or module_name.startswith(error.name + ".")):
            raise SystemExit(
                f"kvtier {' '.join(words)}: not available in this installation ({module_name} is missing). "
                "Update kvtier, or install it from a checkout that has it (pip install -e .)."
            ) from None
        raise SystemExit(
            f"kvtier {' '.join(words)}: cannot start, a module it needs is missing ({error}). "
            "Install the missing package (for the benchmarks: pip install 'kvtier[bench]')."
        ) from None
    entry = getattr(module, "main", None)
    if entry is None:
        raise SystemExit(f"kvtier {' '.join(words)}: {module_name} has no main(argv) function")
    return entry


def main(argv: list[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if not arguments or arguments[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if arguments else EXIT_USAGE
    for words, module_name, _summary in SUBCOMMANDS:
        if tuple(arguments[: len(words)]) == words:
            entry = _load_main(module_name, words)
            return int(entry(arguments[len(words) :]) or 0)
    if arguments[0] == "bench":
        names = ", ".join(words[1] for words, _module, _summary in SUBCOMMANDS if words[0] == "bench")
        given = f" {arguments[1]!r}" if len(arguments) > 1 else ""
        print(f"kvtier bench: unknown benchmark{given}; choose one of: {names}\n", file=sys.stderr)
    else:
        print(f"kvtier: unknown command {arguments[0]!r}\n", file=sys.stderr)
    print(usage(), file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
