"""The `kvtier` command line (also `python -m kvtier`), built on click (docs/cli.md).

    kvtier status PATH        the store: service counters and hit rates, or what its files tell
    kvtier ls PATH            the namespaces under a store path, with their device file geometry
    kvtier serve PATH [...]   the host service that engines share (kvtier.service)
    kvtier demo [...]         the end-to-end demo (kvtier.demo)
    kvtier bench io [...]     the store against fio and LMCache (kvtier.bench.io)
    kvtier bench ttft [...]   time to first token through a real engine (kvtier.bench.ttft)
    kvtier bench lookup       host service round-trip latency (kvtier.bench.lookup)
    kvtier bench layout       TTFT across engines sharing the host service (kvtier.bench.layout)
    kvtier bench reads-first  NVMe-hit tail latency right after heavy stores (kvtier.bench.reads_first)

`serve`, `demo` and the benchmarks keep their own argparse parsers: each lives in its own module with
its own `main(argv)`, imported only when it runs, so that one missing optional part never breaks the
others; every argument after the command's name goes to it unchanged (`--help` included).

Exit status: 0 done, 1 failed (the message names the fix), 2 usage error.
Shell completion: `eval "$(_KVTIER_COMPLETE=bash_source kvtier)"` (zsh_source, fish_source).
"""

from __future__ import annotations

import difflib
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
from click.shell_completion import CompletionItem

EXIT_FAILURE = 1
EXIT_USAGE = 2
PASSTHROUGH = {"ignore_unknown_options": True, "allow_extra_args": True}


def _load_main(module_name: str, words: tuple[str, ...]) -> Callable[[list[str]], int | None]:
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


def _passthrough(group: click.Group, words: tuple[str, ...], module_name: str, summary: str) -> None:
    """A command that hands every argument to ``module_name``'s own ``main(argv)``."""

    @click.pass_context
    def run(ctx: click.Context, args: tuple[str, ...]) -> None:
        status = _load_main(module_name, words)(list(args))
        ctx.exit(int(status or 0))

    command = click.Command(
        words[-1],
        callback=run,
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        help=f"{summary} ({module_name}; `--help` for its options).",
        short_help=summary,
        context_settings=PASSTHROUGH,
        add_help_option=False,
    )
    group.add_command(command)


class _Group(click.Group):
    """A group whose unknown-command error lists the commands there are (exit status 2)."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        name = args[0] if args else ""
        if name and not name.startswith("-") and not ctx.resilient_parsing and self.get_command(ctx, name) is None:
            choices = self.list_commands(ctx)
            close = difflib.get_close_matches(name, choices, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            ctx.fail(f"unknown command {name!r}; choose one of: {', '.join(choices)}.{hint}")
        return super().resolve_command(ctx, args)


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=(
        "\b\nBenchmarks: kvtier bench io, kvtier bench ttft, kvtier bench lookup, kvtier bench layout,\n"
        "kvtier bench reads-first.\n"
        "Run `kvtier COMMAND --help` for the options of one command. Docs: docs/cli.md."
    ),
)
def cli() -> None:
    """kvtier: a tiered KV-cache store for LLM serving."""


@cli.group(cls=_Group)
def bench() -> None:
    """Benchmarks (results in docs/benchmarks.md)."""


for _words, _module, _summary in (
    (("bench", "io"), "kvtier.bench.io", "store and cold retrieve vs fio and LMCache's disk backend"),
    (("bench", "ttft"), "kvtier.bench.ttft", "time to first token through a real engine, with and without kvtier"),
    (("bench", "lookup"), "kvtier.bench.lookup", "round-trip latency of lookups and pins through the host service"),
    (("bench", "layout"), "kvtier.bench.layout", "TTFT in vLLM's default layout: same- and cross-engine hits, TP=2"),
    (("bench", "reads-first"), "kvtier.bench.reads_first", "tail latency of NVMe hits right after heavy stores"),
    (("demo",), "kvtier.demo", "end-to-end demo with a real engine"),
    (("serve",), "kvtier.service", "run the host service for a store path (engines start one when none runs)"),
):
    _passthrough(bench if _words[0] == "bench" else cli, _words, _module, _summary)


def _complete_directories(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    return [CompletionItem(incomplete, type="dir")]  # the shell completes directory names


_paths_argument = click.argument(
    "paths",
    nargs=-1,
    required=True,
    metavar="PATH...",
    type=click.Path(path_type=Path),
    shell_complete=_complete_directories,
)
_socket_option = click.option(
    "--socket",
    type=click.Path(path_type=Path, dir_okay=False),
    help="the service's socket (default: the one engines derive from PATH, kvtier.service.default_socket_path)",
)
_json_option = click.option(
    "--json", "as_json", is_flag=True, help="print one JSON object (docs/cli.md) instead of tables"
)
_plain_option = click.option("--plain", is_flag=True, help="plain-text tables even when rich is installed")


def _report(kind: str, paths: Sequence[Path], socket: Path | None, as_json: bool, plain: bool) -> None:
    from kvtier.ops import report

    make: Callable[..., dict[str, Any]] = report.status_report if kind == "status" else report.ls_report
    try:
        result = make(list(paths), socket)
    except report.OpsError as error:
        raise click.ClickException(f"kvtier {kind}: {error}") from None
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    output = report.Output(plain=plain)
    (report.print_status if kind == "status" else report.print_ls)(result, output)


@cli.command(short_help="the store: service counters and hit rates per tier, or what its files tell")
@_paths_argument
@_socket_option
@_json_option
@_plain_option
def status(paths: tuple[Path, ...], socket: Path | None, as_json: bool, plain: bool) -> None:
    """The store at PATH: the service's counters, capacity and hit rate per tier when a service answers
    on its socket; otherwise "no service running" and what the files tell (namespaces, device file
    geometry). Exit 1 when PATH is not a kvtier store."""
    _report("status", paths, socket, as_json, plain)


@cli.command(name="ls", short_help="the namespaces under a store path, with their device file geometry")
@_paths_argument
@_socket_option
@_json_option
@_plain_option
def ls_command(paths: tuple[Path, ...], socket: Path | None, as_json: bool, plain: bool) -> None:
    """The namespaces under PATH: digest, device file size, geometry from its superblock, and whether
    the service has it open. Exit 1 when PATH is not a kvtier store."""
    _report("ls", paths, socket, as_json, plain)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line and returns its exit status (the `kvtier` script exits with it)."""
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name="kvtier", standalone_mode=True)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return int(exit_.code or 0)
        print(exit_.code, file=sys.stderr)
        return EXIT_FAILURE
    return 0


if __name__ == "__main__":
    sys.exit(main())
