"""glibc's allocator while packing on load: freed weights go back to the system, in nested blocks too."""

import os
import subprocess
import sys

import pytest
import torch

from hf_lowprec import allocator

pytestmark = pytest.mark.skipif(allocator._glibc() is None, reason="glibc's allocator only")


def resident_mib() -> float:
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS")) / 1024


@pytest.fixture(autouse=True)
def glibc_defaults(monkeypatch):
    for name in allocator.USER_SETTINGS:  # a user's setting would switch the mechanism off
        monkeypatch.delenv(name, raising=False)


def test_loading_returns_freed_weights_to_the_system():
    """A 16 MiB tensor freed within ``freed_memory_returned`` is no longer resident after it (unmapped when freed, or
    trimmed from the heap at the end where a free block of the heap served it): a loaded model keeps none of the
    dense weights it was packed from."""
    with allocator.freed_memory_returned():
        weight = torch.ones(4 * 2**20)  # 16 MiB, every page touched
        held = resident_mib()
        del weight
    assert resident_mib() < held - 12


NESTED = """
import ctypes
from hf_lowprec import allocator

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p


def served_by_heap(size):
    address = libc.malloc(size)
    for line in open("/proc/self/maps"):
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return line.rstrip().endswith("[heap]")


with allocator.freed_memory_returned():
    with allocator.freed_memory_returned():
        pass
    print(served_by_heap(8 << 20))
print(served_by_heap(8 << 20))
"""


def test_an_inner_block_leaves_the_outer_setting_in_place():
    """``load_int4_lora`` holds a block around ``from_pretrained``, which holds one per packed weight: when an inner
    block ends, 8 MiB allocated in the outer one still get a mapping of their own (and leave when freed); after the
    outer block, the heap serves them again. In a fresh process: a test process's heap has holes that large."""
    env = {k: v for k, v in os.environ.items() if k not in allocator.USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", NESTED], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["False", "True"]
