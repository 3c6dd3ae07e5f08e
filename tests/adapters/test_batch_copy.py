"""The adapter hands vLLM's batch copy to the transfers layer only where it can run."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vllm package")  # before the imports that need it
import torch

from kvledger.adapters.vllm.batch_copy import vllm_batch_copy
from tests.transfers import layouts
from tests.transfers import test_cuda as cuda_tests

pytestmark = pytest.mark.vllm  # imports the vLLM adapter: not in the fast subset, which runs without vLLM


def test_host_memory_caches_get_no_batch_copy() -> None:
    assert vllm_batch_copy(layouts.cpu_attention().kv_caches) is None
    assert vllm_batch_copy({}) is None


def test_the_installed_vllm_names_the_op_with_the_signature_used() -> None:
    """`swap_blocks_batch(src_ptrs, dst_ptrs, sizes, is_src_access_order_any=False)`."""
    import inspect

    from vllm import _custom_ops as ops

    parameters = list(inspect.signature(ops.swap_blocks_batch).parameters)
    assert parameters[:3] == ["src_ptrs", "dst_ptrs", "sizes"]
    assert all(p.default is not inspect.Parameter.empty
               for p in list(inspect.signature(ops.swap_blocks_batch).parameters.values())[3:])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("build", cuda_tests.BUILDERS)
def test_on_a_gpu_vllms_batch_copy_round_trips_byte_exact(build) -> None:
    case = layouts.on_device(build(), "cuda")
    batch_copy = vllm_batch_copy(case.kv_caches)
    assert batch_copy is not None, "a CUDA build of vLLM ships swap_blocks_batch"
    cuda_tests.test_round_trip_through_the_pinned_tier_is_byte_exact(build, batch_copy=batch_copy)
