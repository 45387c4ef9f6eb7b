"""The int8 backend's reused scratch buffers (hf_lowprec/modules/kernels/scratch.py)."""

import threading

import torch

from hf_lowprec.modules.kernels.scratch import release_scratch, scratch

CPU = torch.device("cpu")


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_kind_reuses_its_buffer_and_grows_to_the_largest_request():
    release_scratch()
    first = scratch("a", (4, 8), torch.int8, CPU)
    assert first.shape == (4, 8) and first.dtype == torch.int8 and first.is_contiguous()
    smaller = scratch("a", (3, 5), torch.int8, CPU)
    assert storage(smaller) == storage(first)  # within the buffer: no new allocation
    larger = scratch("a", (16, 8), torch.int8, CPU)
    assert larger.untyped_storage().nbytes() == 128
    assert storage(scratch("a", (2, 2), torch.int8, CPU)) == storage(larger)  # kept at the larger size
    assert storage(scratch("b", (2, 2), torch.int8, CPU)) != storage(larger)  # another kind, another buffer
    assert scratch("a", (2, 2), torch.int32, CPU).dtype == torch.int32  # another dtype, another buffer


def test_buffers_are_per_thread_and_apart_in_inference_mode():
    release_scratch()
    here = scratch("a", (8,), torch.int8, CPU)
    there = []
    worker = threading.Thread(target=lambda: there.append(storage(scratch("a", (8,), torch.int8, CPU))))
    worker.start()
    worker.join()
    assert there[0] != storage(here)
    with torch.inference_mode():
        inside = scratch("a", (8,), torch.int8, CPU)
        assert inside.is_inference() and storage(inside) != storage(here)
    after = scratch("a", (8,), torch.int8, CPU)
    after.fill_(1)  # writable outside inference mode: not the inference tensor
    assert storage(after) == storage(here)


def test_release_drops_the_buffers():
    old = scratch("a", (1024,), torch.int8, CPU).untyped_storage()  # kept alive here: a new buffer lies elsewhere
    assert storage(scratch("a", (1024,), torch.int8, CPU)) == old.data_ptr()
    release_scratch()
    assert storage(scratch("a", (1024,), torch.int8, CPU)) != old.data_ptr()
