"""Writing files and folders so that nothing already there is lost or half-overwritten: a file through a temporary
file and a rename, a folder through a temporary sibling renamed into place, and the one check of an output folder."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; give the file the mode open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    """The process umask (read from ``/proc`` where it can be: setting it to read it back races with threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def plain_modes(root: str | os.PathLike) -> None:
    """Give ``root`` and everything under it the modes ``mkdir``/``open`` give under the umask (0755/0644 under 022):
    ``mkdtemp`` makes 0700 folders, ``mkstemp`` and safetensors 0600 files. Executable files stay executable."""
    umask = current_umask()
    root = Path(root)
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        executable = path.is_dir() or path.stat().st_mode & 0o111
        os.chmod(path, (0o777 if executable else 0o666) & ~umask)


RUN_FILE = "hf_lowprec_run.json"  # the run record every hf-lowprec run and export folder holds
# where transformers' TensorBoard callback writes under output_dir; exports carry it (the Hub shows it)
TRACES_DIR = "runs"
MODEL_MARKERS = ("config.json", RUN_FILE)  # a folder holding one is a model's: overwrite may replace it


def check_output_dir(out: str | os.PathLike, overwrite: bool, source: str | os.PathLike | None = None) -> None:
    """``ValueError`` unless ``out`` is free to write: absent, an empty folder, or with ``overwrite`` a model folder
    (one holding a :data:`MODEL_MARKERS` file): a folder of other files is never replaced, nor ``source``, the folder
    the model to be written was loaded from (its ``name_or_path``: writing there would destroy the checkpoint)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {str(out)!r} exists and is not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ValueError(f"output folder {str(out)!r} already exists; pass overwrite=True to replace it")
    if source is not None and Path(source).is_dir() and Path(source).resolve().is_relative_to(out.resolve()):
        raise ValueError(
            f"output folder {str(out)!r} is or holds the checkpoint the model was loaded from, which overwrite=True "
            "does not replace; write to another folder"
        )
    if not any((out / marker).is_file() for marker in MODEL_MARKERS):
        raise ValueError(
            f"output folder {str(out)!r} holds no {' or '.join(MODEL_MARKERS)}, so it is not a model folder and "
            "overwrite=True does not replace it; choose another folder, or empty or remove that one yourself"
        )


@contextlib.contextmanager
def atomic_output_dir(
    out: str | os.PathLike, overwrite: bool = False, source: str | os.PathLike | None = None
) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out``; on success it replaces ``out`` in one rename, with the modes a
    plain ``mkdir``/``open`` would have given (:func:`plain_modes`).

    Raises ``ValueError`` if ``out`` exists (and is not empty) without ``overwrite``, or is ``source``, the folder the
    model written was loaded from (:func:`check_output_dir`). On any error the temporary folder is removed and
    ``out`` is left exactly as it was.
    """
    out = Path(out)
    if out.is_symlink():  # written through: the folder it points at is replaced, the link stays
        out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(out)
    check_output_dir(out, overwrite, source)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.{os.getpid()}-", suffix=".partial"))
    try:
        yield tmp
        plain_modes(tmp)
        dropped = sorted({p.name for p in out.iterdir()} - {p.name for p in tmp.iterdir()}) if out.is_dir() else []
        replace_dir(tmp, out)
        if dropped:  # a file the user added there, or one the old run wrote and this one does not: said, not silent
            logger.warning("replaced %s; gone with the old folder: %s", out, ", ".join(dropped))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sweep_leftovers(out: Path) -> None:
    """Clear what writers of ``out`` killed mid-write left beside it (a kill skips every ``except``/``finally``): their
    ``.<name>.<pid>-*.partial`` folders (removed), and an ``.<name>.old-<pid>`` folder, which is ``out`` itself when
    the kill came between :func:`replace_dir`'s two renames (put back) and else a copy left to delete. Only the
    leftovers of processes no longer running are touched; unnamed ones (older versions) once an hour has passed."""
    for path in out.parent.glob(f".{glob.escape(out.name)}.*"):
        rest = path.name[len(out.name) + 2 :]
        if "." in rest.removesuffix(".partial"):  # ".run.v2.<pid>-x.partial" is a writer of run.v2's, not run's
            continue
        if rest.endswith(".partial"):
            pid = rest.split("-", 1)[0]
        elif rest.startswith("old-"):
            pid = rest[4:]
        else:
            continue
        if not _left_by_a_gone_process(path, pid):
            continue
        if rest.startswith("old-") and not out.exists():
            os.replace(path, out)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _left_by_a_gone_process(path: Path, pid: str) -> bool:
    """Whether process ``pid`` (a decimal string; anything else: an unnamed writer) is gone. An unnamed writer counts
    as gone once ``path`` has not changed for an hour."""
    if not pid.isdigit():
        return time.time() - path.stat().st_mtime > 3600
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def replace_dir(src: Path, dst: Path) -> None:
    """Move folder ``src`` to ``dst``, replacing ``dst``; ``dst`` is never half-written (rename, then delete the
    old), and an interrupt between the two renames puts the old one back."""
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    try:
        if dst.exists():
            os.replace(dst, old)
        os.replace(src, dst)
    except BaseException:
        if old.exists() and not dst.exists():
            os.replace(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)
