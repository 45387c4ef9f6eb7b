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


PER_BLOCK = """
import contextlib
import sys
import torch
from torch import nn
from hf_lowprec import allocator

resident = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
pinned, entry = [], []  # small tensors kept alive (they hold the heap's top), RSS as each forward/backward begins


def leave_holes():
    transients = []
    for _ in range(16):  # 32 MiB in 2 MiB blocks (the heap serves them: 32 MiB limit), each followed by a live tensor
        transients.append(torch.ones(2**19))
        pinned.append(torch.ones(2**14))  # so that freed, they are holes between live blocks, not the heap's free top
    del transients


class Fragmenting(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        entry.append(("forward", resident()))
        leave_holes()
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        entry.append(("backward", resident()))
        leave_holes()
        return grad * 2


class Block(nn.Module):
    def forward(self, x):
        return Fragmenting.apply(x)


class Model(nn.Module):

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


with allocator.freed_memory_returned():
    pass  # as after loading: blocks below 32 MiB come from the heap
model, x = Model(), torch.ones(8, requires_grad=True)
returned = allocator.freed_memory_returned_per_block(model) if sys.argv[1] == "1" else contextlib.nullcontext()
with returned:
    model(x).backward()
print(" ".join(f"{phase}:{mib:.1f}" for phase, mib in entry))
"""


def entry_resident_mib(returned: bool) -> tuple[list[float], list[float]]:
    """RSS (MiB) as each block's forward and each block's backward begins, in a fresh process running ``PER_BLOCK``."""
    env = {k: v for k, v in os.environ.items() if k not in allocator.USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", PER_BLOCK, str(int(returned))], capture_output=True, text=True, env=env,
                         check=True).stdout.split()  # fmt: skip
    entries = [(item.split(":")[0], float(item.split(":")[1])) for item in out]
    assert [phase for phase, _ in entries] == ["forward"] * 3 + ["backward"] * 3
    return [mib for _, mib in entries[:3]], [mib for _, mib in entries[3:]]


def test_each_block_returns_the_holes_its_tensors_left_forward_and_backward():
    """Each block frees 32 MiB of heap blocks between live tensors allocated after them. Without the per-block return,
    those pages stay resident as every later block starts; with it, none of them is, forward (returned after each
    block) or backward (as each block's backward begins)."""
    forward, backward = entry_resident_mib(returned=False)
    assert min(forward[1:] + backward) > forward[0] + 24
    forward, backward = entry_resident_mib(returned=True)
    assert max(forward[1:] + backward) < forward[0] + 16  # the live tensors: 1 MiB a block, forward and backward


def test_a_model_without_decoder_blocks_is_refused():
    with pytest.raises(ValueError, match="Linear names no decoder blocks"):
        with allocator.freed_memory_returned_per_block(torch.nn.Linear(2, 2)):
            pass
