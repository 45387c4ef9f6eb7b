"""The folders the project ships beside the library, ``recipes/`` and ``model_cards/``, wherever hf-lowprec runs from.

A wheel maps them into the package (``hf_lowprec.recipes``, ``hf_lowprec.model_cards``; see ``pyproject.toml``) and an
editable install maps them the same way, but Python started in a plain checkout imports ``hf_lowprec/`` from the
source tree, where they are the top-level folders next to it. Both are tried, in that order.
"""

from __future__ import annotations

import importlib.resources
from importlib.resources.abc import Traversable
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def shipped_folder(name: str) -> Traversable:
    """The shipped folder ``name`` (``recipes`` or ``model_cards``) as an ``importlib.resources`` traversable."""
    try:
        return importlib.resources.files(f"hf_lowprec.{name}")
    except ModuleNotFoundError:  # a plain checkout: the folder sits next to the package
        folder = CHECKOUT / name
        if not folder.is_dir():
            raise FileNotFoundError(
                f"hf-lowprec's {name}/ folder is missing: neither hf_lowprec.{name} is installed nor "
                f"{folder} exists; reinstall with `pip install hf-lowprec`"
            ) from None
        return folder
