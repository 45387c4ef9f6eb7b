"""Publishing: export a trained model as a loadable folder with its plan and model card; push it to the Hub.

An exported folder holds
- the weights (``save_pretrained``): ``master`` exports write the high-precision master weights that the
  low-precision layers trained (plain ``transformers`` checkpoint); ``int4-packed`` exports write the
  INT4 layers as real packed codes (two per byte) with their steps and ``quant_method: hf_lowprec`` in
  ``config.json`` (transformers rebuilds them after ``import hf_lowprec``; see ``hf_lowprec.export.hf_quantizer``),
  plus LoRA adapters beside the weights (PEFT format) for INT4 + LoRA runs;
- ``hf_lowprec_plan.json``: the precision plan; ``hf_lowprec_run.json``: the run record (see below);
- ``README.md``: the model card (``model_cards/model_card.md.jinja`` through ``huggingface_hub.ModelCard``).

The run record is a JSON dict: ``name``, ``base_model`` (hub id or None), ``base_model_path``, ``recipe``
(dict), ``dataset``, ``data_kind``, ``plan`` (dict), ``layers`` ([{name, format, params}]), ``plan_rows``
(``PrecisionPlan.summary`` rows), ``training`` (figures), ``eval`` ([{dataset, split, metric, value}]),
``hardware``, ``export`` ({weights, loader, library_name, dtype, description}), and optionally ``adapter``
(LoRA), ``merge`` (re-quantization error of a merged export), ``export_changes`` (what an export did to the weights
the ``eval`` figures measured, one phrase each: re-rounded layers, a merge, a cast; those figures are then labeled as
the trained model's), ``summary`` and ``limitations`` (card text).
"""

import importlib

_LAZY = {  # name -> module; loaded on first use, so that ondevice may import export.records without a circle
    "CARD_FILE": "records",
    "PLAN_FILE": "records",
    "RUN_FILE": "records",
    "hardware_info": "records",
    "read_run": "records",
    "render_model_card": "card",
    "export_model": "folder",
    "export_run": "folder",
    "load_exported": "folder",
    "PushFailed": "publish",
    "push": "publish",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"hf_lowprec.export.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'hf_lowprec.export' has no attribute {name!r}")
