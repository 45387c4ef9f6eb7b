"""glibc's allocator while packing on load: freed weights go back to the system, in nested blocks too; per decoder
block in training, always or above a share of the memory the process can use; that memory, cgroup limits included."""

import os
import subprocess
import sys

import pytest
import torch

from hf_lowprec import allocator

needs_glibc = pytest.mark.skipif(allocator._glibc() is None, reason="glibc's allocator only")


def resident_mib() -> float:
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS")) / 1024


@pytest.fixture(autouse=True)
def glibc_defaults(monkeypatch):
    for name in allocator.USER_SETTINGS:  # a user's setting would switch the mechanism off
        monkeypatch.delenv(name, raising=False)


@needs_glibc
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


@needs_glibc
def test_an_inner_block_leaves_the_outer_setting_in_place():
    """``load_int4_lora`` holds a block around ``from_pretrained``, which holds one per packed weight: when an inner
    block ends, 8 MiB allocated in the outer one still get a mapping of their own (and leave when freed); after the
    outer block, the heap serves them again. In a fresh process: a test process's heap has holes that large."""
    env = {k: v for k, v in os.environ.items() if k not in allocator.USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", NESTED], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["False", "True"]


PER_BLOCK = """
import contextlib
import ctypes
import ctypes.util
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
# glibc trims the heap's top by itself once 128 KiB lie free there (the default M_TRIM_THRESHOLD, fixed once the mmap
# threshold is set): where a pinned tensor took an older hole, the last transients sat at the top and went back by
# chance (RSS 31 MiB lower in some runs). Off here: only a boundary's malloc_trim returns memory, the thing tested.
ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-1, 2**30)  # M_TRIM_THRESHOLD
model, x = Model(), torch.ones(8, requires_grad=True)
setting = sys.argv[1]  # never, always, or MiB over the starting RSS
above = int((resident() + float(setting)) * 2**20) if setting not in ("never", "always") else None
returned = contextlib.nullcontext() if setting == "never" else allocator.freed_memory_returned_per_block(model, above)
with returned:
    model(x).backward()
print(" ".join(f"{phase}:{mib:.1f}" for phase, mib in entry))
"""


def entry_resident_mib(returned: str) -> tuple[list[float], list[float]]:
    """RSS (MiB) as each block's forward and each block's backward begins, in a fresh process running ``PER_BLOCK``
    (``returned``: ``never``, ``always``, or the MiB over its starting RSS above which a boundary returns memory)."""
    env = {k: v for k, v in os.environ.items() if k not in allocator.USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", PER_BLOCK, returned], capture_output=True, text=True, env=env,
                         check=True).stdout.split()  # fmt: skip
    entries = [(item.split(":")[0], float(item.split(":")[1])) for item in out]
    assert [phase for phase, _ in entries] == ["forward"] * 3 + ["backward"] * 3
    return [mib for _, mib in entries[:3]], [mib for _, mib in entries[3:]]


@needs_glibc
def test_each_block_returns_the_holes_its_tensors_left_forward_and_backward():
    """Each block frees 32 MiB of heap blocks between live tensors allocated after them. Without the per-block return,
    those pages stay resident as every later block starts; with it, none of them is, forward (returned after each
    block) or backward (as each block's backward begins)."""
    forward, backward = entry_resident_mib("never")
    assert min(forward[1:] + backward) > forward[0] + 24
    forward, backward = entry_resident_mib("always")
    assert max(forward[1:] + backward) < forward[0] + 16  # the live tensors: 1 MiB a block, forward and backward


@needs_glibc
def test_a_boundary_returns_the_holes_only_above_the_given_resident_memory():
    """``above_bytes`` (what ``return_freed_memory="auto"`` sets): the forward blocks' 32 MiB of holes (partly reused
    by the next block's tensors, or not: two blocks' reach up to 67 MiB over the starting RSS) keep the process under a
    line 96 MiB over it, so they stay; over a line at 16 MiB, they are returned at every boundary (a line at 64 MiB
    failed 1 run in 6: the heap reused no hole and the second block crossed it)."""
    forward, backward = entry_resident_mib("96")
    assert min(forward[1:]) > forward[0] + 24
    forward, backward = entry_resident_mib("16")
    assert max(forward[1:] + backward) < forward[0] + 16


@needs_glibc
def test_returning_freed_memory_by_setting(monkeypatch):
    """``returning_freed_memory``: ``"auto"`` hooks every decoder block while inside (its line: half of
    :func:`usable_memory_bytes`, tested in ``test_ondevice``), removed after; ``False`` is nothing, and so is ``"auto"``
    on a model without decoder blocks; other values are refused with the allowed ones."""
    from conftest import tiny_llama

    from hf_lowprec.allocator import returning_freed_memory

    monkeypatch.setattr(allocator, "usable_memory_bytes", lambda: 3 * 2**30)
    model = tiny_llama()
    with returning_freed_memory(model, "auto"):
        assert all(len(block._forward_hooks) == 1 for block in model.model.layers)
    assert not any(block._forward_hooks for block in model.model.layers)
    for setting in (False, "auto"):
        returned = returning_freed_memory(torch.nn.Linear(2, 2) if setting else model, setting)
        assert type(returned).__name__ == "nullcontext"
    with pytest.raises(ValueError, match="return_freed_memory must be false, true or 'auto', got 'sometimes'"):
        returning_freed_memory(model, "sometimes")


def test_the_cgroup_limit_is_the_lowest_on_the_process_cgroup_and_its_ancestors(tmp_path):
    """v1 (``memory.limit_in_bytes``) and v2 (``memory.max``) folders, found under a container's root with the leading
    parts of the process's cgroup path dropped; ``max``, v1's near-2**63 and what cannot be read are no limit; no memory
    line, no limit."""
    root, membership = tmp_path / "cgroup", tmp_path / "self_cgroup"
    v1 = root / "memory" / "job" / "step"
    v1.mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # the container's root: none
    (root / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{3 * 2**30}\n")
    (v1 / "memory.limit_in_bytes").write_text(f"{5 * 2**30}\n")  # looser than its parent's
    membership.write_text("4:memory:/host/container-id/job/step\n2:cpu,cpuacct:/elsewhere\n")
    assert allocator.cgroup_limit_bytes(root, membership) == 3 * 2**30
    v2 = root / "unified" / "job"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text(f"{2 * 2**30}\n")
    (root / "unified" / "memory.max").write_text("max\n")
    membership.write_text("4:memory:/host/container-id/job/step\n0::/host/container-id/job\n")
    assert allocator.cgroup_limit_bytes(root, membership) == 2 * 2**30
    (v2 / "memory.max").write_text("max\n")
    membership.write_text("0::/host/container-id/job\n")
    assert allocator.cgroup_limit_bytes(root, membership) is None
    (v2 / "memory.max").write_text("garbage\n")  # unreadable files and lines are no limit, not an error
    membership.write_text("nonsense\n0::/host/container-id/job\n")
    assert allocator.cgroup_limit_bytes(root, membership) is None
    assert allocator.cgroup_limit_bytes(root, tmp_path / "absent") is None


def test_usable_memory_is_at_least_what_this_process_holds():
    """Resident memory plus ``MemAvailable`` (or a lower cgroup limit): above this process's RSS, at most the RAM."""
    total = next(int(x.split()[1]) * 1024 for x in open("/proc/meminfo") if x.startswith("MemTotal:"))
    usable, held = allocator.usable_memory_bytes(), allocator.resident_bytes()
    assert held < usable <= total + held
    assert abs(held / 2**20 - resident_mib()) < 8


def test_a_model_without_decoder_blocks_is_refused():
    with pytest.raises(ValueError, match="Linear names no decoder blocks"):
        with allocator.freed_memory_returned_per_block(torch.nn.Linear(2, 2)):
            pass
