"""Error compensation: keep low-precision arithmetic from losing what it cannot represent.

- **Chunked high-precision accumulation** (DeepSeek-V3, section 3.3.2): an FP8 GEMM whose accumulator
  keeps only ~14 mantissa bits (Hopper tensor cores) loses ~2% on K=4096 dot products; summing
  chunks of K=128 in fp32 removes most of it. :func:`chunked_scaled_mm` does that with
  ``torch._scaled_mm``; :func:`emulated_accumulation_matmul` models the low-precision accumulator
  so the error (and its removal) can be measured on any device.
- **Compensated weight updates** for weights kept in bf16 without an fp32 master copy:
  :class:`CompensatedOptimizer` wraps any torch optimizer and adds Kahan compensation buffers or
  stochastic rounding; for weights stored on an INT4/FP8 grid, error feedback carries the
  quantization residual into the next update.
- **Low-precision optimizer states**: :func:`make_optimizer` builds AdamW with fp32, 8-bit, 4-bit or
  FP8 states (torchao, bitsandbytes), optionally wrapped.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from hf_lowprec.formats import (
    E4M3,
    FormatSpec,
    dequantize_nf4,
    fake_quantize_int,
    fp8_quantize_dequantize,
    int_steps,
    quantize_nf4,
)

logger = logging.getLogger(__name__)

ROUNDINGS = ("truncate", "nearest")
METHODS = ("kahan", "stochastic", "none")
STATES = ("fp32", "8bit", "4bit", "fp8", "bnb-8bit")
LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)

# ---------------------------------------------------------------------------- accumulation


def round_mantissa(x: torch.Tensor, mantissa_bits: int, rounding: str = "truncate") -> torch.Tensor:
    """fp32 ``x`` rounded to ``mantissa_bits`` explicit mantissa bits (fp32 keeps 23), fp32 out.

    ``truncate`` rounds toward zero (as tensor-core adders do after aligning operands);
    ``nearest`` rounds half away from zero. Exponent range stays fp32's.
    """
    if not 0 <= mantissa_bits <= 23:
        raise ValueError(f"mantissa_bits must be within 0..23, got {mantissa_bits}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; choose one of {', '.join(ROUNDINGS)}")
    drop = 23 - mantissa_bits
    if drop == 0:
        return x.float()
    bits = x.float().view(torch.int32)
    if rounding == "nearest":
        bits = bits + (1 << (drop - 1))  # sign-magnitude layout: adds half an ulp to the magnitude
    return (bits & ~((1 << drop) - 1)).view(torch.float32)


def emulated_accumulation_matmul(
    a: torch.Tensor, b: torch.Tensor, mantissa_bits: int = 14, chunk: int | None = None, rounding: str = "truncate"
) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` with a low-precision accumulator; fp32 ``[M, N]``.

    Products are exact in fp32 for FP8 operands; each is added to an accumulator that keeps
    ``mantissa_bits`` (~14 on Hopper FP8 tensor cores, as DeepSeek-V3 measures). With ``chunk``, the
    accumulator is promoted to an fp32 sum every ``chunk`` products (DeepSeek-V3 uses 128) and restarts
    at zero. A sequential loop over K: meant for measuring, with small M and N.
    """
    a, b = a.float(), b.float()
    total = torch.zeros(a.shape[0], b.shape[1])
    acc = torch.zeros_like(total)
    for k in range(a.shape[1]):
        acc = round_mantissa(acc + a[:, k, None] * b[None, k, :], mantissa_bits, rounding)
        if chunk is not None and (k + 1) % chunk == 0:
            total += acc
            acc.zero_()
    return total + acc


def chunked_scaled_mm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    chunk: int = 128,
    out_dtype: torch.dtype = torch.float32,
    use_fast_accum: bool = True,
) -> torch.Tensor:
    """FP8 GEMM ``(a_q / a_scale) @ (b_q / b_scale)`` summed over K-chunks of ``chunk`` in fp32.

    ``a_q [M, K]`` row-major, ``b_q [K, N]`` column-major (``w_q.t()``), FP8; scales in this package's
    convention (``q = x * scale``: tensorwise 0-dim, or rowwise ``[M, 1]`` / ``[1, N]``). Each chunk runs
    ``torch._scaled_mm`` (fast, low-precision accumulation allowed inside the chunk) with an fp32 output;
    the chunks add in fp32 — the promotion DeepSeek-V3 does in registers, here as separate GEMMs.
    """
    if chunk % 16:
        raise ValueError(f"chunk must be a multiple of 16 (an FP8 GEMM constraint), got {chunk}")
    sa, sb = a_scale.float().reciprocal(), b_scale.float().reciprocal()
    out = None
    for k0 in range(0, a_q.shape[1], chunk):
        part = torch._scaled_mm(
            a_q[:, k0 : k0 + chunk],
            b_q[k0 : k0 + chunk],
            scale_a=sa,
            scale_b=sb,
            out_dtype=torch.float32,
            use_fast_accum=use_fast_accum,
        )
        out = part if out is None else out.add_(part)
    return out.to(out_dtype)


# ------------------------------------------------------------------------- compensated updates


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to ``dtype`` (bf16 or fp16) up or down with probability proportional to proximity.

    Unbiased: ``E[stochastic_round(x)] = x``. bf16 is fp32's top half, so 16 random bits are added to
    the bits that get cut (``x`` is overwritten when it is fp32); fp16 picks between the nearest value
    and its neighbour.
    """
    if dtype == torch.bfloat16:
        bits = x.float().view(torch.int32)
        bits.add_(torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator))
        return bits.bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)
    if dtype != torch.float16:
        raise ValueError(f"stochastic rounding targets bfloat16 or float16, not {dtype}")
    x = x.float()
    near = x.to(dtype)
    r = near.float()
    toward = torch.where(r < x, float("inf"), float("-inf")).to(dtype)
    other = torch.nextafter(near, toward).float()
    gap = other - r
    p_other = torch.where(gap != 0, (x - r) / gap, torch.zeros_like(x))
    pick = torch.rand(x.shape, device=x.device, generator=generator) < p_other
    return torch.where(pick, other, r).to(dtype)


def _grid_round(w: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """``w`` (fp32, 2-D) rounded onto ``spec``'s grid with scales from ``w`` itself (dynamic)."""
    if spec.family == "fp8":
        return fp8_quantize_dequantize(w, E4M3, spec.granularity, role="weight")
    if spec.family == "nf4":
        idx, absmax = quantize_nf4(w, spec.group_size)
        return dequantize_nf4(idx, absmax, spec.group_size)
    step, zero = int_steps(w, spec)
    return fake_quantize_int(w, spec, step, zero)


class CompensatedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer so bf16/fp16 weights train without an fp32 master copy.

    Per step, each bf16/fp16 parameter is lifted to fp32 (``method="kahan"``: plus its compensation
    buffer), the wrapped optimizer updates that fp32 value, and the result goes back to the parameter:

    - ``kahan``: rounded to nearest; the rounding error is kept in a compensation buffer of the
      parameter's dtype (fp32 for fp16 weights; a bf16 one stored by stochastic rounding) and added back next
      step, so updates smaller than an ulp accumulate instead of vanishing (2 bytes/param instead of a 4-byte
      master copy);
    - ``stochastic``: rounded stochastically (unbiased in expectation; no buffer);
    - ``none``: plain rounding (what training bf16 weights directly does).

    ``error_feedback``: ``{parameter: format}`` for weights stored on an INT4/FP8/NF4 grid (any dtype):
    after each update the weight is rounded onto the grid (scales from the updated weight) and the
    residual, kept in ``residual_dtype``, is added to the next update (error feedback), so updates
    smaller than a grid step are not lost. The parameter holds the dequantized grid values; packing
    them is the layer's job. The residual reaches half a grid step: in bf16, an update below 2^-9 of it
    rounded away (SGD, 10,000 updates of 1e-4 on an INT4 grid: 0.03 moved of 1.0), so fp32 is the default
    and a bf16/fp16 residual is stored by stochastic rounding (unbiased; 2 bytes per weight less).

    The wrapped optimizer sees fp32 parameters, so it creates fp32 (or its own low-bit) states, and it
    must update each parameter independently (SGD, Adam(W), torchao and bitsandbytes optimizers do):
    parameters are stepped in slices of at most ``max_chunk_numel`` elements, bounding the transient
    fp32 copies. Other parameters (fp32) pass through unchanged. ``state_dict`` holds the wrapped
    optimizer's state, the buffers and the random generators' states.

    Written here because no installed library does this for an arbitrary optimizer (torchao's
    optimizers have ``bf16_stochastic_round`` for themselves only; Kahan buffers exist in none).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        method: str = "kahan",
        error_feedback: Mapping[nn.Parameter, FormatSpec | str] | None = None,
        residual_dtype: torch.dtype = torch.float32,
        max_chunk_numel: int = 2**24,
        seed: int = 0,
    ):
        # Like accelerate's AcceleratedOptimizer: an Optimizer (LR schedulers check) that delegates
        # to the wrapped one instead of calling Optimizer.__init__.
        if method not in METHODS:
            raise ValueError(f"unknown compensation method {method!r}; choose one of {', '.join(METHODS)}")
        if isinstance(optimizer, CompensatedOptimizer):
            raise ValueError("optimizer is already a CompensatedOptimizer")
        if isinstance(optimizer, torch.optim.LBFGS):  # a step evaluates the closure itself, over all parameters at once
            raise ValueError(
                "CompensatedOptimizer wraps optimizers that update each parameter on its own (SGD, Adam(W), "
                "Adafactor, torchao and bitsandbytes optimizers), not LBFGS"
            )
        if residual_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"residual_dtype {residual_dtype}: choose torch.float32, torch.bfloat16 or torch.float16")
        self.optimizer = optimizer
        self.method = method
        self.residual_dtype = residual_dtype
        self.max_chunk_numel = max_chunk_numel
        self.seed = seed
        self.error_feedback: dict[int, FormatSpec] = {}
        for p, spec in (error_feedback or {}).items():
            spec = FormatSpec.parse(spec)
            if spec.family not in ("fp8", "int4", "int8", "nf4"):
                raise ValueError(f"error feedback needs an fp8/int4/int8/nf4 format, not {spec.name}")
            if p.dim() != 2:
                raise ValueError(f"error feedback handles 2-D weights, got a parameter of shape {tuple(p.shape)}")
            self.error_feedback[id(p)] = spec
        self.buffers: dict[int, torch.Tensor] = {}  # id(param) -> Kahan compensation or EF residual
        self._generators: dict[str, torch.Generator] = {}

    # delegation ---------------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        feedback = f"error_feedback={len(self.error_feedback)} params"
        return f"CompensatedOptimizer(method={self.method}, {feedback}, {self.optimizer!r})"

    # the step -----------------------------------------------------------------------------
    def _mode(self, p: torch.Tensor) -> str | None:
        if id(p) in self.error_feedback:
            return "ef"
        if p.dtype in LOW_PRECISION_DTYPES and self.method != "none":
            return self.method
        return None

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[key]

    def _lift(self, p: torch.Tensor, mode: str) -> torch.Tensor:
        """The fp32 value the wrapped optimizer updates (a copy: an fp32 weight's too)."""
        hp = p.detach().to(torch.float32, copy=True)
        if mode == "kahan" and id(p) in self.buffers:
            hp.add_(self.buffers[id(p)])
        return hp

    def _lower(self, p: torch.Tensor, new: torch.Tensor, dtype: torch.dtype, mode: str) -> torch.Tensor:
        """The stored value for updated fp32 ``new`` (consumed: overwritten in place); updates the buffers."""
        if mode == "kahan":
            hi = new.to(dtype)
            error = new.sub_(hi)
            # a bf16 buffer is stored by stochastic rounding: rounded to nearest, an update below half its own spacing
            # rounded away, and the buffer stopped growing (20,000 SGD steps of 3e-6 on weights at 1.0 moved
            # nothing, fp32 weights 0.06); unbiased, it sums them as fp32 does
            self.buffers[id(p)] = (
                error.float() if dtype == torch.float16 else stochastic_round(error, dtype, self._generator(new.device))
            )
            return hi
        if mode == "stochastic":
            return stochastic_round(new, dtype, self._generator(new.device))
        residual = self.buffers.get(id(p))
        target = new if residual is None else new.add_(residual)
        on_grid = _grid_round(target, self.error_feedback[id(p)])
        residual = target.sub_(on_grid)
        if self.residual_dtype != torch.float32:
            residual = stochastic_round(residual, self.residual_dtype, self._generator(residual.device))
        self.buffers[id(p)] = residual
        return on_grid.to(dtype)

    def _chunks(self) -> list[list[tuple[int, torch.Tensor]]]:
        """``(group index, param)`` for params with gradients, in slices of ≤ max_chunk_numel lifted elements."""
        chunks: list[list[tuple[int, torch.Tensor]]] = [[]]
        size = 0
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                n = p.numel() if self._mode(p) else 0
                if chunks[-1] and size + n > self.max_chunk_numel:
                    chunks.append([])
                    size = 0
                chunks[-1].append((gi, p))
                size += n
        return chunks

    @torch.no_grad()
    def step(self, closure=None):
        """One step of the wrapped optimizer over fp32 stand-ins of the lifted parameters, lowered back into the
        parameters in place.

        Stand-ins, not ``p.data`` swapped to fp32: a parameter given data of another dtype gets a new gradient
        accumulator, which drops the hook DDP put on the old one, so the ranks' gradients were never averaged. The
        wrapped optimizer's own step hooks run once per step, here, with the parameters in place (a pre-hook that
        clears their gradients, as a gradient spike's skip does, skips the step: its states stay as they were); torch's
        global optimizer hooks run at each chunk's step, seeing its stand-ins."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.optimizer.param_groups
        originals = [g["params"] for g in groups]
        with self._own_step_hooks() as (holder, pre_hooks, post_hooks):
            try:
                self._step_chunks(groups, holder, pre_hooks, post_hooks)
            finally:
                for g, params in zip(groups, originals):
                    g["params"] = params
        return loss

    def _step_chunks(self, groups: list[dict], holder, pre_hooks: dict, post_hooks: dict) -> None:
        """:meth:`step`'s work: the pre-hooks, each chunk's lifted parameters stepped as stand-ins and lowered back,
        the post-hooks (``groups``: the wrapped optimizer's, which each chunk's parameters replace; ``holder``: the
        optimizer the hooks are registered on)."""
        for hook in list(pre_hooks.values()):
            hook(holder, (), {})
        for chunk in self._chunks():
            lifted = {}  # id(param) -> (param, mode, fp32 stand-in)
            for _, p in chunk:
                mode = self._mode(p)
                # no gradient: frozen, or a step a pre-hook skipped (a gradient spike under spike_action="skip"
                # clears every gradient): nothing to lift
                if mode and p.grad is not None:
                    stand_in = self._lift(p, mode)
                    stand_in.grad = p.grad.float()
                    lifted[id(p)] = (p, mode, stand_in)
            for gi, g in enumerate(groups):
                g["params"] = [lifted[id(p)][2] if id(p) in lifted else p for i, p in chunk if i == gi]
            with self._standing_in([(p, stand_in) for p, _, stand_in in lifted.values()]):
                self.optimizer.step()
            for p, mode, stand_in in lifted.values():
                # a global hook skipped the step (cleared the stand-in's gradient): stored value and buffers as they
                # were (lowered again, a lifted value with a Kahan buffer rounds anew)
                if stand_in.grad is not None:
                    p.copy_(self._lower(p, stand_in, p.dtype, mode))
        for hook in list(post_hooks.values()):
            hook(holder, (), {})

    def register_step_pre_hook(self, hook):
        """Registered on the wrapped optimizer: it runs once per step, before the chunks (see :meth:`step`)."""
        return self._hook_holder().register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        """Registered on the wrapped optimizer: it runs once per step, after the chunks (see :meth:`step`)."""
        return self._hook_holder().register_step_post_hook(hook)

    def _hook_holder(self) -> torch.optim.Optimizer:
        """The wrapped optimizer, or, for a wrapper without step hooks of its own (Accelerate's
        ``AcceleratedOptimizer``), the optimizer inside it."""
        holder = self.optimizer
        while not hasattr(holder, "_optimizer_step_pre_hooks") and hasattr(holder, "optimizer"):
            holder = holder.optimizer
        return holder

    @contextlib.contextmanager
    def _own_step_hooks(self):
        """``(optimizer, its pre-hooks, its post-hooks)``: :meth:`_hook_holder`'s step hooks, taken off it within the
        block (its step, once per chunk, then runs none)."""
        holder = self._hook_holder()
        if not hasattr(holder, "_optimizer_step_pre_hooks"):
            yield holder, {}, {}
            return
        pre, post = holder._optimizer_step_pre_hooks, holder._optimizer_step_post_hooks
        holder._optimizer_step_pre_hooks, holder._optimizer_step_post_hooks = type(pre)(), type(post)()
        try:
            yield holder, pre, post
        finally:
            holder._optimizer_step_pre_hooks, holder._optimizer_step_post_hooks = pre, post

    @contextlib.contextmanager
    def _standing_in(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        """Within the block, what the wrapped optimizer keeps per parameter belongs to each ``(parameter, stand-in)``
        pair's stand-in: its state, and bitsandbytes' overrides (``GlobalOptimManager``: by ``id(param)``, and by
        module attribute, as the Trainer gives embeddings 32-bit states, which bitsandbytes resolves against its param
        groups: here against the parameters; its overrides by position in the param groups are set aside, a chunk's
        groups holding other parameters at those positions)."""
        manager = getattr(self.optimizer, "mng", None)
        overrides = getattr(manager, "pid2config", None)
        if overrides is not None:
            lifted = {id(p) for p, _ in pairs}
            for module, name, config in manager.module_weight_config_triple:
                if id(weight := getattr(module, name, None)) in lifted:
                    overrides[id(weight)] = config
        aliased = [] if overrides is None else [(p, s) for p, s in pairs if id(p) in overrides]
        for p, s in aliased:
            overrides[id(s)] = overrides[id(p)]
        positional = None if overrides is None else manager.index2config
        if overrides is not None:
            manager.index2config = {}
        _move_states(self.optimizer.state, pairs)
        try:
            yield
        finally:
            _move_states(self.optimizer.state, [(s, p) for p, s in pairs])
            for _, s in aliased:
                del overrides[id(s)]
            if overrides is not None:
                manager.index2config = positional

    # state --------------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        index = {id(p): i for i, p in enumerate(self._params())}
        return {
            "optimizer": self.optimizer.state_dict(),
            "method": self.method,
            "buffers": {index[k]: v for k, v in self.buffers.items() if k in index},
            "generators": {dev: g.get_state() for dev, g in self._generators.items()},
        }

    def __getstate__(self) -> dict:
        """For ``copy.deepcopy`` and pickle: what is keyed by a parameter's identity keyed by its position (a copy's
        parameters are new objects). torch's ``Optimizer.__getstate__`` kept only the wrapped optimizer's groups."""
        index = {id(p): i for i, p in enumerate(self._params())}
        state = dict(self.__dict__)
        state["buffers"] = {index[k]: v for k, v in self.buffers.items() if k in index}
        state["error_feedback"] = {index[k]: v for k, v in self.error_feedback.items() if k in index}
        return state

    def __setstate__(self, state: dict) -> None:
        """Keyed by the copy's parameters again; torch's ``Optimizer.__setstate__`` patched ``step`` on this class
        itself, which broke every wrapper in the process."""
        self.__dict__.update(state)
        params = self._params()
        self.buffers = {id(params[i]): v for i, v in state["buffers"].items()}
        self.error_feedback = {id(params[i]): v for i, v in state["error_feedback"].items()}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("method") != self.method:
            raise ValueError(
                f"state_dict was saved with method {state_dict.get('method')!r}, this optimizer uses {self.method!r}"
            )
        params = self._params()
        # torch casts floating states to their parameter's dtype on load; the wrapped optimizer's states
        # belong to the fp32 lifted values, so it loads them for fp32 stand-ins (stride-0, no memory), not for the
        # parameters (whose data swapped to fp32 would lose DDP's gradient hooks: see step)
        originals = [g["params"] for g in self.optimizer.param_groups]
        fp32 = torch.float32  # not the default dtype, which a user may have set to bf16
        stand_ins = {id(p): torch.zeros((), dtype=fp32, device=p.device).expand(p.shape) for p in params if self._mode(p)}
        for g in self.optimizer.param_groups:
            g["params"] = [stand_ins.get(id(p), p) for p in g["params"]]
        try:
            self.optimizer.load_state_dict(state_dict["optimizer"])
        finally:  # load_state_dict makes new groups, holding the stand-ins
            for g, group_params in zip(self.optimizer.param_groups, originals):
                g["params"] = group_params
            _move_states(self.optimizer.state, [(stand_ins[id(p)], p) for p in params if id(p) in stand_ins])
        self.buffers = {
            id(params[int(i)]): v.to(params[int(i)].device).clone() for i, v in state_dict["buffers"].items()
        }
        self._generators = {}
        for dev, gen_state in state_dict.get("generators", {}).items():
            self._generator(torch.device(dev)).set_state(gen_state)

    def compensation_bytes(self) -> int:
        """Bytes held in compensation buffers and residuals."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def _move_states(state: Mapping, moves: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """An optimizer's per-parameter ``state`` (keyed by tensor) moved from each ``(old, new)`` pair's old key to new."""
    for old, new in moves:
        if old in state:
            state[new] = state.pop(old)


# ---------------------------------------------------------------------------- optimizer states


def make_optimizer(
    params: Iterable,
    states: str = "fp32",
    compensation: str | None = None,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    **wrapper_options,
) -> torch.optim.Optimizer:
    """AdamW with ``states`` optimizer states, optionally wrapped in a :class:`CompensatedOptimizer`.

    ``states``: ``fp32`` (torch), ``8bit`` / ``4bit`` / ``fp8`` (torchao's AdamW8bit / AdamW4bit /
    AdamWFp8: block-quantized states, 2 / 1 / 2 bytes per parameter for both moments instead of 8;
    tensors under 4096 elements keep fp32 states; ``8bit`` steps fp32 weights on CPUs in one C++ pass,
    :class:`~hf_lowprec.training.adamw8bit.AdamW8bit`, the others compile their first step), ``bnb-8bit``
    (bitsandbytes' AdamW8bit). ``compensation``: ``kahan``, ``stochastic`` or ``None``; with torchao
    states and no fp16 parameter, ``stochastic`` uses torchao's own ``bf16_stochastic_round`` instead of the wrapper
    (it rounds bf16 weights alone: fp16 ones took every sub-ulp update to nearest, which lost it).
    """
    if states not in STATES:
        raise ValueError(f"unknown optimizer states {states!r}; choose one of {', '.join(STATES)}")
    if compensation is not None and compensation not in METHODS:
        raise ValueError(f"unknown compensation {compensation!r}; choose one of {', '.join(METHODS)} or None")
    common = {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps}
    if states == "fp32":
        inner = torch.optim.AdamW(params, **common)
    elif states == "bnb-8bit":
        import bitsandbytes as bnb

        inner = bnb.optim.AdamW8bit(params, **common)
    else:
        import torchao.optim

        from hf_lowprec.training.adamw8bit import AdamW8bit

        cls = {"8bit": AdamW8bit, "4bit": torchao.optim.AdamW4bit, "fp8": torchao.optim.AdamWFp8}[states]
        inner = cls(params, bf16_stochastic_round=compensation == "stochastic", **common)
        fp16 = any(p.dtype == torch.float16 for g in inner.param_groups for p in g["params"])
        if compensation == "stochastic" and not fp16:  # fp16 weights: the wrapper (the inner one sees fp32 stand-ins)
            if wrapper_options:  # the wrapper's, which torchao's rounding does not have
                raise ValueError(
                    f"{', '.join(sorted(wrapper_options))} apply to the CompensatedOptimizer wrapper, which "
                    f"compensation='stochastic' with states={states!r} does not use (torchao rounds stochastically "
                    "itself); use compensation='kahan' or states='fp32' to have them"
                )
            return inner
    if compensation in (None, "none"):
        return inner
    return CompensatedOptimizer(inner, compensation, **wrapper_options)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in optimizer states (tensor subclasses such as torchao's quantized states included)."""
    seen: set[int] = set()

    def size(t) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        inner_names = getattr(t, "__tensor_flatten__", None)
        if inner_names is not None and type(t) is not torch.Tensor and type(t) is not nn.Parameter:
            names, _ = t.__tensor_flatten__()
            return sum(size(getattr(t, n)) for n in names)
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return t.untyped_storage().nbytes()

    inner = optimizer.optimizer if isinstance(optimizer, CompensatedOptimizer) else optimizer
    total = sum(size(v) for state in inner.state.values() for v in state.values())
    if isinstance(optimizer, CompensatedOptimizer):
        total += optimizer.compensation_bytes()
    return total
