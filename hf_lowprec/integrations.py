"""Registration with transformers and PEFT on ``import hf_lowprec``, without importing either.

Registrations make the ecosystem's own loaders understand hf-lowprec folders and layers:

- transformers: ``quant_method: hf_lowprec`` (:mod:`hf_lowprec.export.hf_quantizer`), so
  ``AutoModelForCausalLM.from_pretrained(folder)`` rebuilds packed INT4 layers instead of random ones;
- transformers: ``resize_token_embeddings`` refuses a model whose vocabulary table is an hf-lowprec layer
  (:func:`hf_lowprec.layers.guard_vocabulary_resize`);
- PEFT: packed layers wrap in :class:`~hf_lowprec.modules.int4_lora.PackedLoraLinear`, so
  ``PeftModel.from_pretrained(base, adapter_folder)`` loads adapters onto a packed base, and
  ``target_modules="all-linear"`` includes packed layers.

Importing transformers' model code and PEFT costs seconds, which ``import hf_lowprec`` should not pay for a user who
needs neither. So each registration runs as soon as its library is imported: at once when it already is, otherwise
from a post-import hook on ``sys.meta_path`` (the pattern of ``wrapt``'s post-import hooks) that runs it right after
``transformers.modeling_utils`` or ``peft`` has finished executing (whose import notices of optional kernels are
silenced meanwhile, see :func:`quiet_imports`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import logging
import sys

# module whose import must be followed by registrations -> the "module:function"s doing them
REGISTRATIONS = {
    "transformers.modeling_utils": (
        "hf_lowprec.export.hf_quantizer:register", "hf_lowprec.layers:guard_vocabulary_resize",
    ),
    "peft": ("hf_lowprec.modules.int4_lora:register_peft_dispatch",),
}  # fmt: skip


# loggers whose import-time notices say nothing a user can act on: torchao's optional CUDA extensions (on a CPU
# machine), torch's pytree deprecation notice that torchao triggers, bitsandbytes' optional `kernels` package
IMPORT_NOISE = ("torchao", "torch.utils._pytree", "bitsandbytes")


@contextlib.contextmanager
def quiet_imports():
    """Silence :data:`IMPORT_NOISE` below ERROR while inside (levels restored after): for importing peft, torchao."""
    loggers = [logging.getLogger(name) for name in IMPORT_NOISE]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _run(targets: tuple[str, ...]) -> None:
    for target in targets:
        module, function = target.split(":")
        getattr(importlib.import_module(module), function)()


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the modules of :data:`REGISTRATIONS` it returns the spec the other finders give,
    with a loader that runs the registration once the module has executed. A registration stays pending until its
    module executes: ``importlib.util.find_spec("peft")`` alone (transformers' ``is_peft_available()`` probes so,
    inside ``from_pretrained``) imports nothing, and the import that follows must still register."""

    def __init__(self, pending: dict[str, str]):
        self.pending = pending
        self.resolving: set[str] = set()  # modules whose spec is being found by the other finders

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending or fullname in self.resolving:
            return None
        self.resolving.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.resolving.discard(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def execute_then_register(module):
            with quiet_imports():
                execute(module)
            registration = self.pending.pop(fullname, None)
            if registration is not None:
                _run(registration)

        spec.loader.exec_module = execute_then_register
        return spec


def register_integrations() -> None:
    """Register with every library of :data:`REGISTRATIONS`: now if it is imported, else right after its import."""
    pending = {}
    for module, target in REGISTRATIONS.items():
        if module in sys.modules:
            _run(target)
        else:
            pending[module] = target
    if pending and not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook(pending))
