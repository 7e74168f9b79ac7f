"""The `kvtier` command line (also `python -m kvtier`), built on click (docs/cli.md).

    kvtier status PATH        the store: service counters and hit rates, or what its files tell
    kvtier ls PATH            the namespaces under a store path, with their device file geometry
    kvtier inspect PATH -n NS one namespace: model, dtype, layout, blocks and bytes per tier, dates
    kvtier verify PATH        scrub: re-read and check every block, quarantine bad ones (exit 3)
    kvtier trim PATH ...      remove blocks nobody uses: --to BYTES, --older-than DURATION, --namespace NS
    kvtier top PATH           live view of the running service
    kvtier serve PATH [...]   the host service that engines share (kvtier.service)
    kvtier service stop PATH  stop it (it flushes, frees its pools and exits)
    kvtier demo [...]         the end-to-end demo (kvtier.demo)
    kvtier bench io [...]     the store against fio and LMCache (kvtier.bench.io)
    kvtier bench ttft [...]   time to first token through a real engine (kvtier.bench.ttft)
    kvtier bench lookup       host service round-trip latency (kvtier.bench.lookup)
    kvtier bench admission    writes below DRAM per write_admission (kvtier.bench.admission)
    kvtier bench layout       TTFT across engines sharing the host service (kvtier.bench.layout)
    kvtier bench reads-first  NVMe-hit tail latency right after heavy stores (kvtier.bench.reads_first)
    kvtier bench blocks       TTFT against the engine's block size (kvtier.bench.blocks)
    kvtier bench gpu          the GPU data path against pinned copies and the disk (kvtier.bench.gpu)
    kvtier bench serve        throughput and TTFT against users, under load (kvtier.bench.serve)
    kvtier bench serve-summary  several bench serve runs: medians, plot, targets (kvtier.bench.serve_summary)
    kvtier bench faults       faults injected under load: failed requests, wrong outputs (kvtier.bench.faults)
    kvtier bench tenants      two tenants on one DRAM pool, one flooding it (kvtier.bench.tenants)

`serve`, `demo` and the benchmarks keep their own argparse parsers: each lives in its own module with
its own `main(argv)`, imported only when it runs, so that one missing optional part never breaks the
others; every argument after the command's name goes to it unchanged (`--help` included).

Exit status: 0 done, 1 failed (the message names the fix), 2 usage error, 3 `verify` found bad blocks,
143 stopped by SIGTERM (the demo and the benchmarks stop what they started first, as after Ctrl-C).
Shell completion: `eval "$(_KVTIER_COMPLETE=bash_source kvtier)"` (zsh_source, fish_source).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import click
from click.shell_completion import CompletionItem

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_BAD_BLOCKS = 3
EXIT_TERMINATED = 128 + signal.SIGTERM
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


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is: a benchmark's or the demo's cleanup (servers stopped,
    services stopped, mounts removed, directories deleted) runs as after Ctrl-C. Python's default
    SIGTERM ends the process at once and leaves every `vllm serve` it started running."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; the caller's own handling stays
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(_signum: int, _frame: object) -> None:
        # A second SIGTERM during the cleanup ends the process at once, as a second Ctrl-C would.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise _Terminated()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _by_sigterm(error: BaseException | None) -> bool:
    """Whether ``error`` is SIGTERM's ``_Terminated`` or came of it. Raised inside a callback from
    native code (the core's log lines reach Python's logging), it comes back as the call's
    ``SystemError`` with ``_Terminated`` as its cause."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, _Terminated):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _passthrough(group: click.Group, words: tuple[str, ...], module_name: str, summary: str) -> None:
    """A command that hands every argument to ``module_name``'s own ``main(argv)``."""

    @click.pass_context
    def run(ctx: click.Context, args: tuple[str, ...]) -> None:
        entry = _load_main(module_name, words)
        try:
            with _sigterm_as_interrupt():
                status = entry(list(args))
        except BaseException as error:
            if not _by_sigterm(error):
                raise
            print(f"kvtier {' '.join(words)}: stopped by SIGTERM", file=sys.stderr)
            ctx.exit(EXIT_TERMINATED)
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
        "kvtier bench reads-first, kvtier bench blocks, kvtier bench gpu, kvtier bench serve,\n"
        "kvtier bench serve-summary, kvtier bench faults, kvtier bench admission, kvtier bench tenants.\n"
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
    (("bench", "blocks"), "kvtier.bench.blocks", "TTFT against the engine's block size (seed 002's experiment 3)"),
    (("bench", "gpu"), "kvtier.bench.gpu", "the GPU data path: store/restore GB/s vs pinned copies and O_DIRECT reads"),
    (("bench", "serve"), "kvtier.bench.serve", "throughput and TTFT against users under load, with vllm bench serve"),
    (("bench", "serve-summary"), "kvtier.bench.serve_summary", "bench serve runs in one table and plot"),
    (("bench", "faults"), "kvtier.bench.faults", "faults injected under load (service stopped, killed) vs vLLM alone"),
    (
        ("bench", "tenants"),
        "kvtier.bench.tenants",
        "two tenants on one DRAM pool, one flooding it, with and without shares",
    ),
    (
        ("bench", "admission"),
        "kvtier.bench.admission",
        "NVMe bytes written and hit rate per write_admission, a write budget held",
    ),
    (("demo",), "kvtier.demo", "end-to-end demo with a real engine"),
    (("serve",), "kvtier.service_main", "run the host service for a store path (engines start one when none runs)"),
):
    _passthrough(bench if _words[0] == "bench" else cli, _words, _module, _summary)


def _complete_directories(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    return [CompletionItem(incomplete, type="dir")]  # the shell completes directory names


class _PathAsGiven(click.ParamType):
    """A path, not looked at here: ``click.Path`` stats every path (even with ``exists=False``), and
    on a frozen mount (a FUSE daemon stopped, an NFS server gone) that waits for as long as the mount
    does, before a command could say so. The commands check their paths themselves, within a limit
    where it matters (``kvtier status``, ``kvtier ls``)."""

    name = "path"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        return value if isinstance(value, Path) else Path(value)


_paths_argument = click.argument(
    "paths",
    nargs=-1,
    required=True,
    metavar="PATH...",
    type=_PathAsGiven(),
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


@cli.group(cls=_Group)
def service() -> None:
    """The host service of a store path (engines start one on demand; `kvtier serve` runs one)."""


@service.command(name="stop", short_help="stop the service of a store path (it flushes, frees its pools, exits)")
@_paths_argument
@_socket_option
@click.option("--timeout", "timeout_s", type=float, default=60.0, show_default=True, help="seconds to wait for it")
def service_stop(paths: tuple[Path, ...], socket: Path | None, timeout_s: float) -> None:
    """SIGTERM to the service of PATH, then a wait while it flushes its stores to NVMe, removes its
    pool files from /dev/shm and its socket, and exits. Exit 0 when none runs; 1 when it did not stop
    within --timeout."""
    from kvtier.ops.report import OpsError, socket_named_from
    from kvtier.service import running_service, service_pid, stop_service

    try:
        socket_path = socket or socket_named_from(paths)
    except OpsError as error:
        raise click.ClickException(f"kvtier service stop: {error}") from None
    found = running_service(socket_path)
    if found is None:
        recorded = service_pid(socket_path)
        stale = f" (its pid file names pid {recorded}, which is not that service: left alone)" if recorded else ""
        click.echo(f"kvtier service stop: no service runs on {socket_path}{stale}")
        return
    pid = found[0]
    if not stop_service(socket_path, timeout_s=timeout_s):
        raise click.ClickException(f"kvtier service stop: pid {pid} on {socket_path} still runs after {timeout_s:g} s")
    click.echo(f"kvtier service stop: stopped pid {pid} ({socket_path})")


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
@click.option(
    "--blocks",
    is_flag=True,
    help="also each open namespace's blocks per tier (DRAM, NVMe, shared), from the running service",
)
def ls_command(paths: tuple[Path, ...], socket: Path | None, as_json: bool, plain: bool, blocks: bool) -> None:
    """The namespaces under PATH: digest, device file size, geometry from its superblock, and whether
    the service has it open. With --blocks, the keys of the blocks each namespace the service has
    open holds per tier (counts in the table, hex keys in --json): the set the engines' KV events
    describe. Exit 1 when PATH is not a kvtier store (or, with --blocks, no service answers)."""
    if not blocks:
        _report("ls", paths, socket, as_json, plain)
        return
    from kvtier.ops import report

    try:
        result = report.add_blocks(report.ls_report(list(paths), socket))
    except report.OpsError as error:
        raise click.ClickException(f"kvtier ls: {error}") from None
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    output = report.Output(plain=plain)
    report.print_ls(result, output)
    report.print_blocks(result, output)


_namespace_option = click.option(
    "--namespace",
    "-n",
    metavar="NS",
    help="one namespace: a digest prefix (4+ hex digits, `kvtier ls` lists them) or a model name",
)


def _ops_call(name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    from kvtier.ops.report import OpsError

    try:
        return run()
    except OpsError as error:
        raise click.ClickException(f"kvtier {name}: {error}") from None
    except Exception as error:  # a typed kvtier error from the core or the service: its message names the fix
        from kvtier.errors import KvtierError

        if isinstance(error, KvtierError):
            raise click.ClickException(f"kvtier {name}: {error}") from None
        raise


@cli.command(short_help="one namespace: description, blocks and bytes per tier, oldest and newest block")
@_paths_argument
@click.option(
    "--namespace",
    "-n",
    required=True,
    metavar="NS",
    help="the namespace: a digest prefix (4+ hex digits, `kvtier ls` lists them) or a model name",
)
@_socket_option
@_json_option
@_plain_option
def inspect(paths: tuple[Path, ...], namespace: str, socket: Path | None, as_json: bool, plain: bool) -> None:
    """One namespace under PATH (NS: a digest prefix of 4+ hex digits, or the model name): what it
    holds (model, dtype, layout, parallel layout, tokens per block), its blocks and bytes per tier,
    and its oldest and newest block. From the service when it has the namespace open, else from the
    store's files (the namespace is opened here, so no other process may hold it)."""
    from kvtier.ops import maintenance, views

    report = _ops_call("inspect", lambda: maintenance.inspect(list(paths), socket, namespace))
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    views.print_inspect(report, plain)


@cli.command(short_help="scrub: re-read and check every block, quarantine bad ones (exit 3 if any)")
@_paths_argument
@_namespace_option
@click.option(
    "--max-mbps",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="read at most this many MB/s (10^6 bytes) per namespace; 0: as fast as the disk goes",
)
@click.option(
    "--shared-root",
    type=click.Path(path_type=Path),
    default=None,
    help="for namespaces opened from their files: also scrub their shared tier in this directory "
    "(the service scrubs its own shared tier without it)",
)
@click.option(
    "--shared-key-file",
    type=click.Path(path_type=Path),
    default=None,
    help="the deployment key of that shared tier (shared_key_file), if it has one",
)
@_socket_option
@_json_option
@_plain_option
def verify(
    paths: tuple[Path, ...],
    namespace: str | None,
    max_mbps: float,
    shared_root: Path | None,
    shared_key_file: Path | None,
    socket: Path | None,
    as_json: bool,
    plain: bool,
) -> None:
    """Re-reads every block of every namespace under PATH (its DRAM copy and its NVMe entry, and its
    shared-tier copy), checks descriptor and checksum, and quarantines bad copies: they become misses,
    never served, and leave their region's trailer (or the shared index). Through the running service
    for the namespaces it has open (safe while engines serve), from the files for the others (their
    shared tier with --shared-root). Exit 0 all good, 3 bad blocks found, 1 failed."""
    from kvtier.ops import maintenance, views

    with views.progress_reporter(enabled=not plain and sys.stderr.isatty(), what="verify") as progress:
        report = _ops_call(
            "verify",
            lambda: maintenance.verify(
                list(paths),
                socket,
                namespace,
                max_mbps,
                progress=progress,
                shared_root=shared_root,
                shared_key_file=shared_key_file,
            ),
        )
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        views.print_verify(report, plain)
    if not report["ok"]:
        sys.exit(EXIT_BAD_BLOCKS)


@cli.command(short_help="remove blocks nobody uses: --to BYTES, --older-than DURATION, --namespace NS")
@_paths_argument
@click.option(
    "--to", "to_bytes", metavar="BYTES", help="NVMe bytes to keep per namespace (oldest regions go): 20G, 512M"
)
@click.option("--older-than", metavar="DURATION", help="remove blocks stored longer ago than this: 90s, 30m, 6h, 2d")
@_namespace_option
@_socket_option
@_json_option
@_plain_option
def trim(
    paths: tuple[Path, ...],
    to_bytes: str | None,
    older_than: str | None,
    namespace: str | None,
    socket: Path | None,
    as_json: bool,
    plain: bool,
) -> None:
    """Frees cache space, safe while engines run: nothing pinned, being filled, read or written is
    removed. --to BYTES: each namespace's NVMe tier down to BYTES (oldest whole regions first).
    --older-than DURATION: blocks stored longer ago. --namespace NS alone: every block of NS;
    with --to or --older-than: only NS."""
    from kvtier.ops import maintenance, views

    try:
        size = maintenance.parse_size(to_bytes) if to_bytes is not None else None
        age = maintenance.parse_duration(older_than) if older_than is not None else None
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    report = _ops_call("trim", lambda: maintenance.trim(list(paths), socket, namespace, size, age))
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        views.print_trim(report, plain)


@cli.command(short_help="live view of the running service: hit rates, GB/s, queues, drops, top namespaces")
@_paths_argument
@_socket_option
@click.option(
    "--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True, help="seconds between refreshes"
)
@click.option("--once", is_flag=True, help="print one frame (after one interval) and exit")
def top(paths: tuple[Path, ...], socket: Path | None, interval: float, once: bool) -> None:
    """A live terminal view of the service serving PATH (q or Ctrl-C quits): hit rate per tier,
    GB/s stored and loaded, NVMe reads and writes, queue depths, drops, the busiest namespaces, and
    per engine (engine_label) its lookups, hit rate and the slices its ranks loaded and stored."""
    from kvtier.ops import top as top_view

    def run() -> dict[str, Any]:
        top_view.run(list(paths), socket, interval, once)
        return {}

    _ops_call("top", run)


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
