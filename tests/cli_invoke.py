"""The ``hf-lowprec`` command run in this process, as the CLI tests run it."""

from pathlib import Path

from hf_lowprec.cli.app import app
from tiny_assets import corpus_text, save_tiny_model
from transformers.utils import logging as hf_logging
from typer.testing import CliRunner


def workspace(folder: Path, corpus_chars: int) -> Path:
    """``folder`` with a tiny model (``tiny/``) and a text corpus of ``corpus_chars`` characters (``corpus.txt``)."""
    save_tiny_model(folder / "tiny")
    (folder / "corpus.txt").write_text(corpus_text(corpus_chars))
    return folder


def cli(*args, env: dict[str, str] | None = None):
    """``hf-lowprec ARGS...`` (any objects, as strings) with ``env`` set around it; typer's ``Result``. transformers'
    progress bars, which the command turns off for its process, are turned on again after it when they were on: tests
    run after it in this process (an auto scan's bar) would find them off."""
    bars = hf_logging.is_progress_bar_enabled()
    try:
        return CliRunner().invoke(app, [str(a) for a in args], env=env)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def one_error_line(result):
    """The output of a run that failed as bad input must: exit status 2, one ``error:`` line, no traceback."""
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert "Traceback" not in text and text.count("error:") == 1, text
    return text
