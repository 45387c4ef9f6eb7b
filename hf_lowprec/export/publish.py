"""Publishing an exported folder to the Hugging Face Hub."""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.utils import HFValidationError, validate_repo_id

from hf_lowprec.export.card import render_model_card
from hf_lowprec.export.records import CARD_FILE, RUN_FILE, card_edited, published, read_run, record_text
from hf_lowprec.ondevice.export import ADAPTER_CONFIG, adapter_config_naming, adapter_folder

MODEL_CONFIG = "config.json"
# a model's own files, at the top of a repo (names as fnmatch patterns), and its folders (an older export's adapters,
# TensorBoard traces): those of a repo the pushed folder does not hold are deleted with the push (an earlier push's
# adapters stayed and were applied to the next push's merged model); a repo's other files (a licence, images, an
# eval_results.json, other formats in folders of their own) stay
MODEL_FILES = (
    "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.gguf", "*.model", "*.jinja",
    "config.json", "generation_config.json", "adapter_config.json", "tokenizer*", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.json", "preprocessor_config.json",
    "processor_config.json", "hf_lowprec_*", "recipe.yaml", "loss_curve.png", "finetune_metrics.json",
)  # fmt: skip
MODEL_FOLDERS = ("adapter", "runs")


class PushFailed(RuntimeError):
    """The Hub refused or could not be reached (the folder and the repo id passed the local checks)."""


def push(
    folder: str | os.PathLike, repo_id: str, *, private: bool = False, create_pr: bool = False, token: str | None = None
) -> str:
    """Create ``repo_id`` (if needed) and upload ``folder``; returns the commit or pull-request URL.

    ``folder``: an hf-lowprec run or export folder (or a plain model folder with ``config.json``). ``repo_id``
    without a namespace is created under the token's user, as ``create_repo`` does, and the card names the full id.
    The token comes from ``token``, else the usual places (``HF_TOKEN``, ``hf auth login``); it is sent only in
    request headers, never logged or written. The card's loading snippets are re-rendered for the repo in the upload
    only (a card edited since the export goes as it is), with the run record naming that card: ``folder`` itself is
    never written. Hidden files, unfinished writes and a run folder's checkpoints and log stay local; the repo's
    model files (:func:`model_file`) the folder does not hold are deleted in the same commit. ``private``: an
    existing public repo is refused (the Hub keeps an existing repo's visibility). Raises ``ValueError`` for bad
    input, :class:`PushFailed` when the Hub refuses or cannot be reached.
    """
    folder, run = _checked(folder, repo_id)
    token = token or get_token()
    if not token:
        raise ValueError("no Hugging Face token found: set HF_TOKEN or run `hf auth login`")
    api = HfApi(token=token)
    with _hub_refusals(repo_id, token):
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        public = private and not api.repo_info(repo_id).private
    if public:
        raise ValueError(
            f"{repo_id} exists and is public: --private does not change an existing repo's visibility; make it "
            "private in its settings on the Hub, or push without --private"
        )
    card = _card(folder, run, repo_id)
    with _staged(folder, card, repo_id, run) as upload, _hub_refusals(repo_id, token):
        message = "Upload model trained with hf-lowprec"
        stale = [f for f in api.list_repo_files(repo_id) if model_file(f) and not (upload / f).is_file()]
        info = api.upload_folder(folder_path=upload, repo_id=repo_id, create_pr=create_pr, commit_message=message,
                                 delete_patterns=[glob.escape(f) for f in stale] or None)  # fmt: skip
    return info.pr_url or info.commit_url


@contextlib.contextmanager
def _hub_refusals(repo_id: str, token: str):
    """The errors of the Hub calls within (huggingface_hub's HTTP, validation and connection errors) as one
    :class:`PushFailed` line, the token masked; the traceback is dropped, as it may hold the token (headers)."""
    try:
        yield
    except Exception as e:
        message = str(e).replace(token, "***").strip().splitlines()
        raise PushFailed(f"push to {repo_id!r} failed: {message[0] if message else type(e).__name__}") from None


def push_preview(folder: str | os.PathLike, repo_id: str) -> tuple[dict[str, int], str | None]:
    """What :func:`push` would upload to ``repo_id``, with no token and no request: ``({path in the repo: bytes},
    the card re-rendered for repo_id, or None for a plain model folder)``; the same checks as :func:`push`. An id
    without a namespace is named ``<user>/<id>`` in the card, as push names the token's user."""
    folder, run = _checked(folder, repo_id)
    repo_id = repo_id if "/" in repo_id else f"<user>/{repo_id}"  # push names the id the Hub creates: the token's user
    card = _card(folder, run, repo_id)
    with _staged(folder, card, repo_id, run) as stage:  # the files as uploaded: card, adapters' config rewritten
        return {str(p.relative_to(stage)): p.stat().st_size for p in sorted(stage.rglob("*")) if p.is_file()}, card


def model_file(path: str) -> bool:
    """Whether ``path`` (in a repo) is one of a model's own files (:data:`MODEL_FILES`, :data:`MODEL_FOLDERS`)."""
    top, _, rest = path.partition("/")
    return top in MODEL_FOLDERS if rest else any(fnmatch.fnmatchcase(top, p) for p in MODEL_FILES)


def _checked(folder: str | os.PathLike, repo_id: str) -> tuple[Path, dict | None]:
    """``(folder, its run record or None for a plain model folder)`` once ``folder`` is one to push and ``repo_id``
    is valid."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{str(folder)!r} is not a folder to push")
    if not (folder / RUN_FILE).is_file() and not (folder / MODEL_CONFIG).is_file():
        raise ValueError(
            f"{str(folder)!r} is not an hf-lowprec run or export folder (no {RUN_FILE} or {MODEL_CONFIG}); "
            "push the folder `hf-lowprec export` wrote"
        )
    check_repo_id(repo_id)
    return folder, read_run(folder) if (folder / RUN_FILE).is_file() else None


def _card(folder: Path, run: dict | None, repo_id: str) -> str | None:
    """The model card as uploaded to ``repo_id``: re-rendered from ``run`` for it, or ``None`` (the folder's own, if
    any): a plain model folder's, or one edited since the export (its metadata and text are the user's)."""
    if run is None or card_edited(folder, run):
        return None
    return render_model_card(run, repo_id).content


def edited_card(folder: str | os.PathLike) -> bool:
    """Whether ``folder``'s model card was edited since hf-lowprec wrote it: :func:`push` uploads it as it is."""
    folder = Path(folder)
    return (folder / RUN_FILE).is_file() and card_edited(folder, read_run(folder, whole=False))


def check_repo_id(repo_id: str) -> None:
    """``ValueError`` (huggingface_hub's reason, one line) for a string the Hub takes as no repo id."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(f"repo id {repo_id!r}: {str(e).strip().splitlines()[0]}") from None


@contextlib.contextmanager
def _staged(folder: Path, card: str | None, repo_id: str, run: dict | None) -> Iterator[Path]:
    """``folder`` as it is uploaded to ``repo_id``: a temporary folder of links to its :func:`published` files (no
    bytes copied) with ``card`` as its README.md (``None``: the folder's own) and, for an hf-lowprec folder (``run``)
    holding LoRA adapters, their config naming ``repo_id`` as their base (they go onto this folder's packed model;
    ``AutoPeftModelForCausalLM`` reads it)."""
    stage = Path(tempfile.mkdtemp(prefix="hf-lowprec-push-"))
    adapters = adapter_folder(folder) if run is not None else None
    adapter_config = adapters / ADAPTER_CONFIG if adapters is not None else None
    rendered = {folder / CARD_FILE, folder / RUN_FILE} if card is not None else set()  # (a card: a run's, re-rendered)
    replaced = {adapter_config} | rendered
    try:
        for path in folder.rglob("*"):
            target = stage / path.relative_to(folder)
            if path.is_file() and path not in replaced and published(path, folder):
                target.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(path.resolve(), target)
        if card is not None:
            (stage / CARD_FILE).write_bytes(card.encode())
        if rendered:  # the record of the card uploaded: a download of the repo pushed elsewhere is no edited card
            (stage / RUN_FILE).write_text(record_text(run, card.encode()))
        if adapter_config is not None:
            (stage / adapter_config.relative_to(folder)).write_text(adapter_config_naming(adapter_config, repo_id))
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)
