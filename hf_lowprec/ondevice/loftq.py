"""LoftQ initialisation: LoRA adapters that start as the truncated SVD of each INT4 layer's quantization residual."""

from __future__ import annotations

import logging
import math

import torch
from peft import LoraConfig
from torch import nn

from hf_lowprec.convert import canonical_name
from hf_lowprec.modules.int4 import Int4Linear
from hf_lowprec.modules.packed import PackedInt4Linear

logger = logging.getLogger(__name__)


@torch.no_grad()
def loftq_factors(residual: torch.Tensor, rank: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LoRA ``(A [r, K], B [N, r])`` with ``scaling * B @ A`` the best rank-``r`` approximation of ``residual [N, K]``.

    LoftQ (Li et al., 2023), one alternation: the adapters start as the truncated SVD of the
    quantization residual ``W - dequant(Q(W))``, so the INT4 model starts where the full-precision one was.
    """
    u, s, vh = torch.linalg.svd(residual.float(), full_matrices=False)
    root = s[:rank].sqrt() / math.sqrt(scaling)
    return (root.unsqueeze(1) * vh[:rank]).contiguous(), (u[:, :rank] * root).contiguous()


def lora_scaling(config: LoraConfig) -> float:
    return config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)


def loftq_for_targets(
    model: nn.Module, config: LoraConfig, dense_weights=None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """LoftQ factors for every LoRA target that the plan put in int4 (called before ``freeze``); a layer packed while
    loading takes its residual against the checkpoint weight ``dense_weights("<layer>.weight")`` reads."""
    scaling = lora_scaling(config)
    out = {}
    for fqn in config.target_modules:
        module = model.get_submodule(fqn)
        if not isinstance(module, (Int4Linear, PackedInt4Linear)) or module.spec.family != "int4":
            continue
        if isinstance(module, PackedInt4Linear):
            if dense_weights is None:
                raise ValueError(f"LoftQ of {fqn!r} (packed while loading) needs its checkpoint weight: dense_weights=")
            residual = dense_weights(f"{fqn}.weight").float() - module.dequantized_weight(torch.float32)
        else:
            residual = module.weight.detach().float() - module.dequantized_weight().detach().float()
        out[canonical_name(fqn)] = loftq_factors(residual, config.r, scaling)
    return out
