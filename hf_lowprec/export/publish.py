"""Publishing an exported folder to the Hugging Face Hub."""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import HfApi, get_token

from hf_lowprec.export.card import render_model_card
from hf_lowprec.export.records import CARD_FILE, RUN_FILE, read_run
from hf_lowprec.folders import atomic_write_text


def push(
    folder: str | os.PathLike, repo_id: str, *, private: bool = False, create_pr: bool = False, token: str | None = None
) -> str:
    """Create ``repo_id`` (if needed) and upload ``folder``; returns the commit or pull-request URL.

    The token comes from ``token``, else the usual places (``HF_TOKEN``, ``hf auth login``); it is sent
    only in request headers, never logged or written. The card's loading snippet is re-rendered for ``repo_id``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{str(folder)!r} is not a folder to push")
    token = token or get_token()
    if not token:
        raise ValueError("no Hugging Face token found: set HF_TOKEN or run `hf auth login`")
    if (folder / RUN_FILE).is_file():
        atomic_write_text(folder / CARD_FILE, render_model_card(read_run(folder), repo_id).content)
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(
            folder_path=folder,
            repo_id=repo_id,
            create_pr=create_pr,
            commit_message="Upload model trained with hf-lowprec",
        )
    except Exception as e:  # huggingface_hub raises HTTP, validation and connection errors
        message = str(e).replace(token, "***").strip().splitlines()
        raise ValueError(f"push to {repo_id!r} failed: {message[0] if message else type(e).__name__}") from None
    return info.pr_url or info.commit_url
