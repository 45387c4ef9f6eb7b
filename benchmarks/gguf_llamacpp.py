"""Does llama.cpp compute what the run trained? A GGUF export (``hf-lowprec export --format gguf``) run by llama.cpp
against the run's own model, on the run's held-out blocks.

The default CLI recipe (``int4-ondevice-lora``: packed INT4 base, learned steps, LoRA r=16 on every linear) fine-tunes
SmolLM2-135M-Instruct on the offline Shakespeare corpus for ``--steps`` steps; the run is exported to ``model.gguf`` +
``adapter.gguf``; llama.cpp (through llama-cpp-python, in the Python given by ``--llama-python``: it is no dependency
of hf-lowprec, and its wheel builds llama.cpp from source, about 10 minutes on 2 cores) evaluates the held-out blocks
with and without the adapter; hf-lowprec's model (fp32, exact dequantized kernels) evaluates the same blocks. Reported:
mean loss (nats/token) of each and of the model before training, the largest logit difference and the top-1 agreement
on the first block (llama.cpp rounds activations to 8 bits for its Q4_1 products: close, not equal).

    python -m venv /tmp/llcpp && /tmp/llcpp/bin/pip install llama-cpp-python
    .venv/bin/python benchmarks/gguf_llamacpp.py --llama-python /tmp/llcpp/bin/python   # results/gguf_llamacpp.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from _util import machine, write_json

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python installed")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
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
    }
    path = write_json("gguf_llamacpp.json", result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
