"""Does llama.cpp compute what the run trained? A GGUF export (``hf-lowprec export --format gguf``) run by llama.cpp
against the run's own model, on the run's held-out blocks.

The default CLI recipe (``int4-ondevice-lora``: packed INT4 base, learned zero points, LoRA r=16 on every linear)
fine-tunes SmolLM2-135M-Instruct on the offline Shakespeare corpus for ``--steps`` steps; the run is exported to
``model.gguf`` + ``adapter.gguf``; llama.cpp (through llama-cpp-python, in the Python given by ``--llama-python``: it
is no dependency of hf-lowprec, and its wheel builds llama.cpp from source, about 10 minutes on 2 cores) evaluates the
held-out blocks with and without the adapter; hf-lowprec's model (fp32, exact dequantized kernels) evaluates the same
blocks. Reported: mean loss (nats/token) of each and of the model before training, the largest logit difference and
the top-1 agreement on the first block (llama.cpp rounds activations to 8 bits for its Q4_1 products: close, not
equal). Then llama.cpp tokenizes text from its vocabulary alone (``tokenizer.ggml.pre`` decides how it splits):
held-out passages and a line of numbers and contractions, against transformers' tokenizer, for the run's SmolLM2
export and for a tiny Llama exported with a BPE vocabulary trained on Llama 3's split (the split of Llama 3's own
tokenizer.json).

    python -m venv /tmp/llcpp && /tmp/llcpp/bin/pip install llama-cpp-python
    .venv/bin/python benchmarks/gguf_llamacpp.py --llama-python /tmp/llcpp/bin/python   # results/gguf_llamacpp.json

``--shape llama-3.2-1b`` instead exports ``scale.py``'s random-weight checkpoint of that shape (GQA, Llama 3's rope
scaling, a tied 128k-row head packed in int8) as load_int4_lora's defaults pack it, with a byte-level vocabulary of
its size, and compares llama.cpp's logits on one block of random tokens with hf-lowprec's (the ``real_shape`` entry).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from _util import RESULTS, machine, write_json

LLAMA_CPP = """
import json, sys
import numpy as np
from llama_cpp import Llama
folder, adapter, blocks = sys.argv[1], sys.argv[2] == "adapter", json.loads(open(sys.argv[3]).read())
kwargs = {"lora_path": f"{folder}/adapter.gguf"} if adapter else {}
llm = Llama(model_path=f"{folder}/model.gguf", n_ctx=len(blocks[0]), logits_all=True, verbose=False, n_threads=2,
            **kwargs)
losses, first = [], None
for ids in blocks:
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
    first = logits if first is None else first
    shifted = logits[:-1] - logits[:-1].max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    losses.append(float(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))
np.save(sys.argv[4], first)
print(json.dumps({"loss": float(np.mean(losses)), "llama_cpp": __import__("llama_cpp").__version__}))
"""

LLAMA_CPP_TOKENIZE = """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
texts = json.loads(open(sys.argv[2]).read())
print(json.dumps([llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts]))
"""
# digits in runs of 1-7, contractions in both cases, punctuation runs and blank lines: where the splits differ
SPLIT_PROBE = "In 1623, 45 copies cost 3.14159 or 1000000 marks; I'LL pay 7, she'd say: \"isn't it?\" -- 2024!\n\n  Exit."


def llama_cpp_tokens(llama_python: str, gguf_file: Path, texts: list[str], work: Path) -> list[list[int]]:
    """llama.cpp's ids of ``texts`` (no BOS, special tokens as text) from ``gguf_file``'s vocabulary."""
    (work / "texts.json").write_text(json.dumps(texts))
    done = subprocess.run([llama_python, "-c", LLAMA_CPP_TOKENIZE, str(gguf_file), str(work / "texts.json")],
                          check=True, capture_output=True, text=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def token_agreement(tokenizer, theirs: list[list[int]], texts: list[str]) -> dict:
    """How transformers' ids of ``texts`` compare with llama.cpp's: texts tokenized identically, tokens, and the
    first differing text's pieces (transformers', llama.cpp's) around the first difference."""
    ours = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    same = [a == b for a, b in zip(ours, theirs)]
    result = {"texts": len(texts), "identical_texts": sum(same), "tokens": sum(map(len, ours))}
    if not all(same):
        a, b = next((a, b) for a, b, ok in zip(ours, theirs, same) if not ok)
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        result["first_difference"] = [tokenizer.convert_ids_to_tokens(ids[at : at + 4]) for ids in (a, b)]
    return result


def llama3_split_export(texts: list[str], work: Path) -> tuple[Path, object]:
    """A tiny Llama whose BPE vocabulary (2,048 tokens) was trained on ``texts`` with Llama 3's split and its merge
    rules (``ignore_merges``, as Llama 3's tokenizer.json), exported to GGUF: ``(model.gguf, tokenizer)``."""
    import inspect

    from peft import LoraConfig
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from hf_lowprec import load_int4_lora
    from hf_lowprec.export.gguf import MODEL_FILE, export_gguf

    split = inspect.signature(TikTokenConverter.__init__).parameters["pattern"].default  # Llama 3's tiktoken pattern
    bpe = Tokenizer(models.BPE(ignore_merges=True))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    bpe.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    numbers = " ".join(str(n) for n in range(0, 3000, 7))  # often enough that digit groups become tokens
    bpe.train_from_iterator(texts + [numbers] * 50, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=special[0], eos_token=special[1])
    folder = work / "llama3-split"
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=1)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model, tokenizer, _ = load_int4_lora(str(folder), LoraConfig(r=4, target_modules="all-linear"), dtype=torch.float32)
    (work / "llama3-gguf").mkdir()
    export_gguf(model, tokenizer, work / "llama3-gguf", "llama3-split")
    return work / "llama3-gguf" / MODEL_FILE, tokenizer


def byte_level_vocabulary(size: int):
    """A byte-level BPE tokenizer of exactly ``size`` tokens (a random-weight checkpoint has none): the 256 byte
    symbols, then pairs of them, then pairs followed by a symbol, each with the merge that makes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab, merges = {s: i for i, s in enumerate(symbols)}, []
    pairs = [(a, b) for a in symbols for b in symbols]
    for left, right in pairs + [(a + b, c) for a, b in pairs for c in symbols]:
        if len(vocab) == size - 1:  # one left for the end-of-text token
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    bpe = Tokenizer(models.BPE(vocab, merges))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|end_of_text|>")


def real_shape_check(shape: str, llama_python: str, work: Path) -> dict:
    """llama.cpp's logits against hf-lowprec's (fp32, exact kernels) on one block of 128 random tokens, for the
    base ``load_int4_lora`` packs from ``scale.py``'s random-weight ``shape`` checkpoint and its GGUF export."""
    from peft import LoraConfig
    from scale import checkpoint

    from hf_lowprec import load_int4_lora
    from hf_lowprec.checkpoints import cache_root
    from hf_lowprec.export.gguf import MODEL_FILE, export_gguf

    folder = checkpoint(cache_root() / "scale", shape)
    model, _, report = load_int4_lora(str(folder), LoraConfig(r=16, target_modules="all-linear"), backend="dequant", dtype=torch.float32)
    tokenizer = byte_level_vocabulary(model.config.vocab_size)
    written = export_gguf(model, tokenizer, work, shape)
    ids = torch.randint(0, model.config.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad(), model.disable_adapter():
        ours = model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    (work / "blocks.json").write_text(json.dumps([ids]))
    subprocess.run([llama_python, "-c", LLAMA_CPP, str(work), "none", str(work / "blocks.json"), str(work / "real.npy")],
                   check=True, capture_output=True, text=True)  # fmt: skip
    theirs = np.load(work / "real.npy")
    centered = [x - x.mean(-1, keepdims=True) for x in (ours, theirs)]
    return {
        "shape": shape,
        "what": f"{shape} random-weight checkpoint (scale.py), packed as load_int4_lora's defaults; one block of 128 "
        "random tokens, no adapters",
        "layers_per_format": dict(Counter(r.applied for r in report.layers)),
        "tensor_types": written["tensor_types"],
        "model_gguf_bytes": (work / MODEL_FILE).stat().st_size,
        "max_abs_logit_diff": float(np.abs(theirs - ours).max()),
        "logit_scale": float(np.abs(ours).max()),
        "relative_rms_diff": float(np.sqrt(((theirs - ours) ** 2).mean() / (centered[0] ** 2).mean())),
        "logit_correlation": float(np.corrcoef(centered[0].ravel(), centered[1].ravel())[0, 1]),
        "top1_agreement": float((theirs.argmax(-1) == ours.argmax(-1)).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python installed")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--shape", help="instead: the export of scale.py's random-weight checkpoint of this shape "
                        "(e.g. llama-3.2-1b) against llama.cpp, recorded as real_shape")  # fmt: skip
    args = parser.parse_args()
    if args.shape:
        with tempfile.TemporaryDirectory() as work:
            found = {"machine": machine(), **real_shape_check(args.shape, args.llama_python, Path(work))}
        path = RESULTS / "gguf_llamacpp.json"
        result = {**(json.loads(path.read_text()) if path.is_file() else {}), "real_shape": found}
        print(json.dumps(found, indent=2))
        print(f"wrote {write_json(path.name, result)}")
        return
    from hf_lowprec.data import prepare_run_data, read_source
    from hf_lowprec.export import load_exported
    from hf_lowprec.export.records import read_run
    from hf_lowprec.recipe import Recipe

    with tempfile.TemporaryDirectory() as work:
        run, out = Path(work) / "run", Path(work) / "gguf"
        cli = [sys.executable, "-m", "hf_lowprec.cli.app"]
        subprocess.run([*cli, "finetune", "--max-steps", str(args.steps), "-o", str(run)], check=True)
        subprocess.run([*cli, "export", str(run), "--out", str(out), "--format", "gguf"], check=True)
        record = read_run(run)
        model, tokenizer = load_exported(run, dtype=torch.float32, backend="dequant")
        records, name = read_source(None)
        held_out = prepare_run_data(records, name, tokenizer, Recipe.from_dict(record["recipe"])).eval
        blocks = [list(ids) for ids in held_out["input_ids"]]
        (Path(work) / "blocks.json").write_text(json.dumps(blocks))
        ours, first = [], None
        with torch.no_grad():
            for ids in blocks:
                logits = model(input_ids=torch.tensor([ids])).logits[0].double()
                first = logits.numpy() if first is None else first
                ours.append(float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))))
        with torch.no_grad(), model.disable_adapter():
            base = float(np.mean([torch.nn.functional.cross_entropy(model(input_ids=torch.tensor([ids])).logits[0, :-1].double(), torch.tensor(ids[1:])) for ids in blocks]))  # fmt: skip
        runs = {}
        for adapter in ("adapter", "none"):
            done = subprocess.run(
                [args.llama_python, "-c", LLAMA_CPP, str(out), adapter, str(Path(work) / "blocks.json"),
                 str(Path(work) / f"{adapter}.npy")],  # fmt: skip
                check=True, capture_output=True, text=True,
            )
            runs[adapter] = json.loads(done.stdout.strip().splitlines()[-1])
        theirs = np.load(Path(work) / "adapter.npy")
        sizes = {p.name: p.stat().st_size for p in out.iterdir() if p.suffix == ".gguf"}
        texts = [tokenizer.decode(ids) for ids in blocks] + [SPLIT_PROBE]
        tokens = {"smollm2 export": token_agreement(tokenizer, llama_cpp_tokens(args.llama_python, out / "model.gguf", texts, Path(work)), texts)}
        llama3_file, llama3_tokenizer = llama3_split_export(list(records["text"]), Path(work))
        tokens["llama 3 split export"] = token_agreement(
            llama3_tokenizer, llama_cpp_tokens(args.llama_python, llama3_file, texts, Path(work)), texts
        )
        for name, found in tokens.items():
            found["tokenizer.ggml.pre"] = gguf_pre(out / "model.gguf" if name.startswith("smollm2") else llama3_file)
    result = {
        "machine": machine(),
        "what": f"SmolLM2-135M-Instruct, recipe int4-ondevice-lora, {args.steps} steps; {len(blocks)} held-out blocks "
        f"of {len(blocks[0])} tokens",
        "llama_cpp_python": runs["adapter"]["llama_cpp"],
        "loss_hf_lowprec": float(np.mean(ours)),
        "loss_hf_lowprec_without_adapters": base,
        "loss_run_record": record["training"]["loss_final"],
        "loss_before_training": record["training"]["loss_base"],
        "loss_llama_cpp": runs["adapter"]["loss"],
        "loss_llama_cpp_without_adapter": runs["none"]["loss"],
        "first_block_max_abs_logit_diff": float(np.abs(theirs - first).max()),
        "first_block_logit_scale": float(np.abs(first).max()),
        "first_block_top1_agreement": float((theirs.argmax(-1) == first.argmax(-1)).mean()),
        "file_bytes": sizes,
        "tokenization_llama_cpp_vs_transformers": tokens,
    }
    earlier = RESULTS / "gguf_llamacpp.json"
    if earlier.is_file() and "real_shape" in (recorded := json.loads(earlier.read_text())):
        result["real_shape"] = recorded["real_shape"]  # the --shape check, recorded in the same file, stays
    path = write_json("gguf_llamacpp.json", result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")


def gguf_pre(path: Path) -> str:
    """The ``tokenizer.ggml.pre`` a GGUF file names."""
    import gguf

    return gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents()


if __name__ == "__main__":
    main()
