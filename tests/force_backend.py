"""pytest plugin (``make test-each-backend``): packed layers' ``backend="auto"`` takes the kernel ``FORCE_BACKEND``
names first wherever it can run, instead of the one timed fastest, so that a test that holds only where one kernel is
fastest fails on every machine, not only on a CPU whose timings differ (a modelled AVX2 CPU found five, 2026-12-06).
Tests of the timing itself (marked ``times_kernels``) are left out."""

import os

import pytest

# each backend's preference: a forward's kernel, then "/int8" variants (exact forward, int8 grad-input)
ORDERS = {
    "int8": ["int8", "tiled/int8", "dequant/int8", "tiled", "dequant"],
    "tiled": ["tiled", "tiled/int8", "dequant", "dequant/int8", "int8"],
    "dequant": ["dequant", "dequant/int8", "tiled", "tiled/int8", "int8"],
}


def pytest_configure(config):
    import hf_lowprec.modules.packed as packed
    from hf_lowprec.modules.kernels import autotune

    name = os.environ.get("FORCE_BACKEND", "int8")
    if name not in ORDERS:
        raise pytest.UsageError(f"FORCE_BACKEND={name!r}: choose one of {', '.join(ORDERS)}")
    order = ORDERS[name]

    def forced(key, candidates, why, clock=None):
        winner = min(candidates, key=order.index)
        choice = autotune.Choice(winner, f"forced by FORCE_BACKEND={name}", {})
        autotune._store(key, choice)  # child processes reuse it, as they reuse a measured choice
        return choice

    packed.fastest = forced


def pytest_collection_modifyitems(config, items):
    timing = [item for item in items if item.get_closest_marker("times_kernels")]
    if timing:
        config.hook.pytest_deselected(items=timing)
        items[:] = [item for item in items if not item.get_closest_marker("times_kernels")]
