"""Terminal output of the CLI: rich consoles, progress for long steps, tables, one-line errors."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from typer.core import TyperGroup

import hf_lowprec

# the package's code and the CLI's (hf_lowprec.cli, a folder of its own in an editable install)
OWN_FOLDERS = (Path(hf_lowprec.__file__).resolve().parent, Path(__file__).resolve().parent)
PIPED_WIDTH = 160  # columns of output that goes to a file or a CI log, unless $COLUMNS says otherwise


def _console(stderr: bool) -> Console:
    """rich's console on stdout or stderr. Piped to a file or a CI log, rich would wrap at 80 columns, breaking the
    paths and commands printed across lines and squeezing tables: there it takes ``PIPED_WIDTH`` columns and leaves
    long lines whole."""
    stream = sys.stderr if stderr else sys.stdout
    piped = not (hasattr(stream, "isatty") and stream.isatty())
    width = int(os.environ.get("COLUMNS", PIPED_WIDTH)) if piped else None
    return Console(stderr=stderr, highlight=False, soft_wrap=piped, width=width)


out = _console(stderr=False)  # results: tables, summaries
err = _console(stderr=True)  # progress, warnings, errors

EXIT_FAILED = 1  # the operation failed (a diverged run, the Hub refused): not the arguments
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class Terminated(KeyboardInterrupt):
    """SIGTERM where no training step can be finished first (loading, evaluating, scanning, exporting): the command
    stops as after Ctrl-C, with the exit status a shell reports for SIGTERM."""

    exit_code = 128 + 15


@contextlib.contextmanager
def terminated_as_interrupt():
    """Within the block SIGTERM raises :class:`Terminated` (its default kills the process at once, so that no clean-up
    runs); a handler installed inside the block (the training's) takes over while it is installed."""

    def handle(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.code = code


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    raise CLIError(message, code)


def check_output_location(path: Path, option: str) -> None:
    """Fail in one line for an output ``path`` under a file, where no folder can be made (it was a FileExistsError),
    or whose name is not UTF-8 (tokenizers' and safetensors' writers refuse it: a finetune failed after training)."""
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        fail(f"{option} {str(path)!r}: the name is not UTF-8, which the model writers need; choose another")
    if file := next((p for p in path.parents if p.exists() and not p.is_dir()), None):
        fail(f"{option} {str(path)!r}: {str(file)!r} is a file, not a folder to write in")


def setup_logging(verbose: bool = False) -> None:
    """Library logs (warnings by default) through rich on stderr; transformers/datasets bars off (ours replace them)."""
    # basicConfig leaves an already configured root logger (an embedding application, pytest) alone
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err, show_path=False, show_time=False)],
    )
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader and hub downloads use tqdm directly
    import datasets
    import transformers

    # deprecation notices inside transformers/peft are for library authors, not for CLI users
    warnings.filterwarnings("ignore", category=FutureWarning)
    # optional-kernel notices of torchao (no triton) and bitsandbytes (no `kernels` package) say nothing actionable
    for name in ("torchao", "bitsandbytes"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # huggingface_hub and datasets print their records (a Hub request's retries) through a handler of their own and
    # pass them on to ours: each came twice
    for library in (logging.getLogger("huggingface_hub"), logging.getLogger("datasets")):
        for handler in [h for h in library.handlers if type(h) is logging.StreamHandler]:
            library.removeHandler(handler)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    # datasets logs a file it cannot parse as an ERROR, then raises; the one error line the CLI prints says it
    datasets.utils.logging.set_verbosity(logging.CRITICAL)


def guarded(fn):
    """Run a command: bad input → one red line and exit 2; Ctrl-C → exit 130, SIGTERM → 143 (both after the
    command's clean-ups); other errors → one line (traceback with HF_LOWPREC_DEBUG=1)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with terminated_as_interrupt():  # clean-ups (temporary folders, a run's work folder) run after SIGTERM
                return fn(*args, **kwargs)
        except CLIError as e:
            _error_line(str(e))
            raise typer.Exit(e.code) from None
        except ValueError as e:
            if os.environ.get("HF_LOWPREC_DEBUG"):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else "invalid input"
            _error_line(first if _raised_by_hf_lowprec(e) else f"{first} (set HF_LOWPREC_DEBUG=1 for the traceback)")
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except KeyboardInterrupt as e:
            _error_line("interrupted")
            raise typer.Exit(getattr(e, "exit_code", EXIT_INTERRUPTED)) from None
        except typer.Exit:
            raise
        except Exception as e:
            if os.environ.get("HF_LOWPREC_DEBUG"):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _error_line(f"{type(e).__name__}: {first} (set HF_LOWPREC_DEBUG=1 for the traceback)")
            raise typer.Exit(EXIT_FAILED) from None

    return wrapper


def _raised_by_hf_lowprec(e: BaseException) -> bool:
    """Whether ``e`` comes from hf-lowprec's own checks of its input (its innermost frame in this package), not from
    inside a library it called, whose message alone may not say what went wrong."""
    frames = list(traceback.walk_tb(e.__traceback__))
    where = Path(frames[-1][0].f_code.co_filename).resolve() if frames else None
    return where is not None and any(where.is_relative_to(folder) for folder in OWN_FOLDERS)


class OneLineUsageErrors(TyperGroup):
    """typer's command group, its usage errors (an option's value out of range, an unknown option or command) said as
    the commands' own refusals are: one ``error:`` line naming the problem and the ``--help`` to read, exit status 2
    (typer boxes them under the usage text)."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)  # an Exit's status, or the command's None
        except typer.TyperException as e:  # typer's click's ClickException
            if type(e).__name__ != "NoArgsIsHelpError":  # bare `hf-lowprec`: the help is shown already
                ctx, said = getattr(e, "ctx", None), e.format_message().removesuffix(".")
                _error_line(said + (f" (see '{ctx.command_path} --help')" if ctx is not None else ""))
            sys.exit(e.exit_code)
        except typer.Abort:
            _error_line("aborted")
            sys.exit(EXIT_FAILED)
        sys.exit(code or 0)


def _error_line(message: str) -> None:
    """``error: message``, the message as it is: brackets in it (a path ``out[/v2]``, torch's ``[enforce fail at
    ...]``) are text, not rich markup, which ate them or failed on them."""
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, markup=True, highlight=False)


@contextlib.contextmanager
def step(description: str) -> Iterator[None]:
    """A spinner with elapsed time while a long step runs (a plain "…" line when stderr is no terminal); a ✓ line
    with its duration after."""
    start = time.perf_counter()
    if not err.is_terminal:
        err.print(f"… {description}", highlight=False)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as progress:
        progress.add_task(description, total=None)
        yield
    err.print(f"[green]✓[/] {description} [dim]({time.perf_counter() - start:.1f} s)[/]")


class Counter:
    """``counter(n)`` advances a bar by ``n``; ``counter.set(done, total)`` moves it to ``done`` of ``total``."""

    def __init__(self, progress: Progress, task):
        self.progress, self.task = progress, task

    def __call__(self, n: int = 1) -> None:
        self.progress.advance(self.task, n)

    def set(self, done: int, total: int) -> None:
        self.progress.update(self.task, completed=done, total=total)


@contextlib.contextmanager
def counted(description: str, total: int, unit: str = "rows") -> Iterator[Counter]:
    """A bar over ``total`` items (a plain "…" line when stderr is no terminal); yields a :class:`Counter`."""
    start = time.perf_counter()
    if not err.is_terminal:
        err.print(f"… {description} ({total} {unit})", highlight=False)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as progress:
        yield Counter(progress, progress.add_task(description, total=total))
    err.print(f"[green]✓[/] {description} [dim]({time.perf_counter() - start:.1f} s)[/]")


def training_progress() -> Progress:
    """The bar of a training run: steps done, time left, last loss."""
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps"),
        TimeElapsedColumn(),
        TextColumn("<"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[loss]}"),
        console=err,
    )


def table(title: str, columns: Iterable[str], rows: Iterable[Iterable], numeric: Iterable[int] = ()) -> Table:
    """A rich table; columns whose index is in ``numeric`` are right-aligned, the first never wraps."""
    t = Table(title=title, title_justify="left", header_style="bold")
    numeric = set(numeric)
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if i in numeric else "left", no_wrap=i == 0)
    for row in rows:
        t.add_row(*(str(v) for v in row))
    return t


def key_values(title: str, items: Mapping[str, object]) -> Table:
    t = Table(title=title, title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    for k, v in items.items():
        t.add_row(k, str(v))
    return t


def plan_rows_table(rows: list[dict], title: str = "Precision plan") -> Table:
    """``PrecisionPlan.summary`` rows as a table. A high-precision row (``bf16``/``fp32``: layers left as they are)
    reads ``kept (<dtype>)``, the dtype its weights are stored in, which its MiB count (as the model card's)."""
    from hf_lowprec.plan import row_label  # torch: not at import (--help stays fast)

    return table(
        title,
        ("format", "layers", "parameters", "share", "weight MiB"),
        [
            (row_label(r), r["layers"], f"{r['params']:,}", f"{100 * r['fraction']:.1f}%", f"{r['bytes'] / 2**20:.2f}")
            for r in rows
        ],
        numeric=(1, 2, 3, 4),
    )

