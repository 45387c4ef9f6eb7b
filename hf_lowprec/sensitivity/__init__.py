"""Sensitivity scan and budgeted precision allocation.

:func:`scan` scores, for every eligible layer (``nn.Linear``, ``nn.Embedding``, the output head) and
every candidate format, how much the calibration loss rises when *only that layer* runs in that format:

- ``measured``: run the calibration batches with the layer's output replaced by its low-precision
  twin (the same classes :func:`hf_lowprec.convert.apply_plan` installs), record Δloss and the KL
  divergence of the logits from the unquantized model's.
- ``fisher``: one forward/backward per batch. For each layer output ``y`` and format, the output
  perturbation ``δy = y_q - y`` is computed from the same input; a second-order Taylor expansion
  with the empirical Fisher for the Hessian gives ``Δloss ≈ (gᵀδy + ½ Σ g² δy²) / N``, with ``g``
  the gradient of the summed token loss w.r.t. ``y`` and ``N`` the calibration tokens. This is
  ModelOpt AutoQuantize's output-space score (which keeps only the ``g²δy²`` term) plus the
  first-order term: working in output space covers activation quantization (FP8 inputs, ``-a8``)
  as well as weight error, and needs activation gradients only.
- ``auto``: ``fisher`` for every layer, then ``measured`` for the (layer, format) pairs with the
  highest predicted Δloss per byte saved: the choices a budget decides on first, and the largest
  perturbations, where a Taylor estimate is least reliable.

Twins run through forward hooks on the original layers: the scan swaps no module (only
:mod:`hf_lowprec.convert` does), so module objects, parameters, gradients and train/eval modes are
exactly as they were afterwards, also after an interrupt. (``apply_plan`` + ``revert`` would leave
new ``nn.Linear`` objects behind.) Measured Δloss includes the first-order effect of the calibration
data's gradient; the Fisher estimate keeps that term for the same reason.

What a choice costs the allocator is the budget's ``score``: ``conversion`` (the model converted as it is) or
``after-training`` (the curvature term only; why: :meth:`LayerScore.score`).

:func:`allocate` turns a :class:`ScanResult` and a :class:`Budget` into an explicit
:class:`~hf_lowprec.plan.PrecisionPlan` by solving a multiple-choice knapsack (:func:`check_budget` tells before a
scan whether its budget can be met at all); :func:`measure_plan` measures a whole plan's Δloss on held-out batches.

Layers that share one weight (tied input/output embeddings) are scored and allocated as one unit.
"""

from hf_lowprec.sensitivity.allocate import Budget, allocate, check_budget, check_budget_fields, predict_plan
from hf_lowprec.sensitivity.results import KEEP, LayerScore, ScanResult
from hf_lowprec.sensitivity.scan import DEFAULT_FORMATS, METHODS, check_formats, measure_plan, scan

__all__ = [
    "Budget",
    "DEFAULT_FORMATS",
    "KEEP",
    "LayerScore",
    "METHODS",
    "ScanResult",
    "allocate",
    "check_budget",
    "check_budget_fields",
    "check_formats",
    "measure_plan",
    "predict_plan",
    "scan",
]
