"""What the model, engine and speculative-decoding tests share (and fixtures other test modules import)."""
import pytest
import torch

# per-op backends: the fp32 torch references, and the Triton kernels (interpreter on the CPU)
TORCH = {"sparse_mla_decode": "torch", "indexer_topk": "torch_fallback", "fused_moe": "torch"}
TRITON = {"sparse_mla_decode": "mma", "indexer_topk": "triton", "fused_moe": "triton"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny matmuls: one thread is ~100x faster than two on a busy 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 references' matmuls must be fp32 (dsv4lab.train turns TF32 on globally); autouse
    in the modules that import it."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = prev
