"""FlashMLA's sparse FP8 decode as an external backend of ``sparse_mla_decode`` ("flash_mla").

FlashMLA (github.com/deepseek-ai/FlashMLA) is DeepSeek's own decode-attention library. Its
sparse FP8 decode for V4 (the "MODEL1" cache layout, 64 heads, D = d_v = 512) runs on sm_90a
and sm_100f only: the workbook measures the project's kernels beside it on the same GPU
(``dsv4lab bench sparse_mla``, rows of backend "flash_mla"), and a user who has it can pick
it by name. It is not a dependency: install FlashMLA (its setup.py, or a build of just the
sm_90 MODEL1 64-head decode) so that ``import flash_mla`` works. "auto" never takes it: the
project's FP8 kernel runs on every GPU, level with it or ahead at V4's shapes (`dsv4lab bench
sparse_mla`).

The layout. The project's FP8 cache is one 584-byte row a token (:mod:`dsv4lab.quant.kv_fp8`:
448 e4m3, 64 bf16 RoPE values, 7 ue8m0 scales, a zero byte). FlashMLA's MODEL1 cache holds the
same bytes in pages of ``bs`` tokens::

    block b:  bs x 576 bytes   token t's 448 e4m3 + 64 bf16 RoPE values at t * 576
              bs x   8 bytes   token t's 7 scales + 1 pad byte at bs * 576 + t * 8
              zeros            up to the block stride, a multiple of 576 bytes

passed as uint8 [blocks, bs, 1, 584] with strides (block stride, 584, 584, 1): the kernel
computes the addresses itself. So the conversion (:func:`to_model1`) moves bytes and changes no
value, and a flat slot n sits in block n // bs at offset n % bs, whose FlashMLA index
(block * bs + offset) is n again: the indices pass unchanged (-1 stays empty). It runs once per
cache tensor: the result is kept while the tensor lives and is not written (keyed by its
address, shape and version counter, with a weak reference to it).

Conventions. FlashMLA wants topk a multiple of 64 (the list is padded with -1), a bf16 q, and
treats only -1 as empty (an index outside [0, N) would read out of bounds, so such indices are
made -1 first; the op's value checks still refuse them). Its lse is [B, H, S_q], leaves the
sink out, and is +inf for a row with no valid slot; the op's lse is [B, S_q, H], the natural
log of the denominator with exp(sink) in it, and -inf (or the sink) for such a row, whose
output is 0 in both.

Inside a CUDA-graph capture the conversion is not cached (it is captured, so each replay
converts the cache as it is then): a graph replays no Python, so a kept copy could not see the
cache change between replays. The benchmark times FlashMLA's own call on inputs already in
its layout (:func:`prepare`, :func:`call`), as its users run it.
"""
from __future__ import annotations

import functools
import weakref
from pathlib import Path
from typing import NamedTuple

import torch

from dsv4lab import backends, runtime
from dsv4lab.quant.kv_fp8 import NOPE_DIM, ROPE_DIM, ROW_BYTES

OP = "sparse_mla_decode"
HEADS = 64                      # V4's query heads: FlashMLA's MODEL1 64-head kernel
DIM = 512
BLOCK_SIZE = 64                 # tokens a page of the converted cache
TOPK_MULTIPLE = 64              # FlashMLA's index block
VALUE_BYTES = NOPE_DIM + 2 * ROPE_DIM        # 576: a token's e4m3 + bf16 part
SCALE_BYTES = ROW_BYTES - VALUE_BYTES         # 8: its scales and the pad byte
STRIDE_QUANTUM = 576            # a block's stride is a multiple of this
CAPABILITIES = ((9, 0), (10, 3))   # sm_90a .. sm_100f (sm_100, sm_103)


# ----------------------------------------------------------------------------------------
# Availability
# ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _import_failure() -> str | None:
    """Why ``import flash_mla`` fails here (None: it imports)."""
    try:
        import flash_mla  # noqa: F401
    except Exception as e:  # noqa: BLE001  (any failure: the package, its CUDA module, torch ABI)
        return (f"needs FlashMLA's flash_mla package (github.com/deepseek-ai/FlashMLA, built "
                f"for this GPU); import flash_mla failed: {type(e).__name__}: {e}")
    return None


def available() -> bool:
    """Whether ``import flash_mla`` works in this process (the GPU is checked at resolution)."""
    return _import_failure() is None


def peer_commit() -> str:
    """The FlashMLA build's commit: its package's COMMIT file, else its version string."""
    import flash_mla
    path = Path(flash_mla.__file__).resolve().parent / "COMMIT"
    if path.is_file():
        return path.read_text().strip()
    return f"version {getattr(flash_mla, '__version__', 'unknown')}"


# ----------------------------------------------------------------------------------------
# The layout conversion (plain torch)
# ----------------------------------------------------------------------------------------

def block_stride(block_size: int = BLOCK_SIZE) -> int:
    """Bytes from one MODEL1 block to the next: ``block_size`` x 584, rounded up to a multiple
    of 576."""
    return -(-block_size * ROW_BYTES // STRIDE_QUANTUM) * STRIDE_QUANTUM


def to_model1(kv: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """The project's FP8 cache uint8 [N, 584] -> FlashMLA's MODEL1 cache, uint8
    [ceil(N / block_size), block_size, 1, 584] with strides (:func:`block_stride`, 584, 584, 1)
    over one buffer; the slots past N are zero."""
    if not isinstance(kv, torch.Tensor) or kv.dtype != torch.uint8 or kv.dim() != 2 \
            or kv.shape[1] != ROW_BYTES:
        got = f"{tuple(kv.shape)} {kv.dtype}" if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"kv must be the FP8 cache, uint8 [N, {ROW_BYTES}]; got {got}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    n, bs = kv.shape[0], block_size
    blocks = max(1, -(-n // bs))
    stride = block_stride(bs)
    buf = torch.zeros(blocks, stride, dtype=torch.uint8, device=kv.device)
    values = buf[:, :bs * VALUE_BYTES].view(blocks, bs, VALUE_BYTES)
    scales = buf[:, bs * VALUE_BYTES:bs * ROW_BYTES].view(blocks, bs, SCALE_BYTES)
    full = n // bs
    if full:
        head = kv[:full * bs].view(full, bs, ROW_BYTES)
        values[:full] = head[..., :VALUE_BYTES]
        scales[:full] = head[..., VALUE_BYTES:]
    if n > full * bs:
        tail = kv[full * bs:]
        values[full, :tail.shape[0]] = tail[:, :VALUE_BYTES]
        scales[full, :tail.shape[0]] = tail[:, VALUE_BYTES:]
    return torch.as_strided(buf, (blocks, bs, 1, ROW_BYTES), (stride, ROW_BYTES, ROW_BYTES, 1))


# the converted copy of each live cache tensor: (address, shape, device, block size) ->
# (version counter, weak reference to the tensor that owns the memory, converted cache)
_CONVERTED: dict[tuple, tuple[int, weakref.ref, torch.Tensor]] = {}


def converted(kv: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """:func:`to_model1` of ``kv``, converted once and kept while ``kv``'s memory lives and is
    not written (a write bumps its version counter; a freed tensor's weak reference dies, so a
    new tensor at the same address converts again). Not kept while a CUDA graph is captured."""
    if runtime.is_capturing(kv):
        return to_model1(kv, block_size)
    owner = kv._base if kv._base is not None else kv
    key = (kv.data_ptr(), tuple(kv.shape), tuple(kv.stride()), str(kv.device), block_size)
    hit = _CONVERTED.get(key)
    if hit is not None and hit[0] == kv._version and hit[1]() is owner:
        return hit[2]
    out = to_model1(kv, block_size)
    ref = weakref.ref(owner, lambda _r, key=key: _drop(key, _r))
    _CONVERTED[key] = (kv._version, ref, out)
    return out


def _drop(key, ref) -> None:
    """The owner of a kept conversion died: free the copy (if it is still that owner's)."""
    hit = _CONVERTED.get(key)
    if hit is not None and hit[1] is ref:
        del _CONVERTED[key]


def clear_cache() -> None:
    """Forget every kept conversion."""
    _CONVERTED.clear()
    _METADATA.clear()


# ----------------------------------------------------------------------------------------
# The call
# ----------------------------------------------------------------------------------------

# FlashMLA's tile-scheduler metadata (built by its first call of a shape, then reused) per
# (device, B, S_q, H, topk, block size)
_METADATA: dict[tuple, object] = {}


class Prepared(NamedTuple):
    """Inputs in FlashMLA's layout: the MODEL1 cache, the indices (padded to a multiple of 64,
    out-of-range ones made -1) and the scheduler metadata for this shape."""
    kcache: torch.Tensor
    indices: torch.Tensor
    meta: object


def _metadata(q: torch.Tensor, topk: int, block_size: int, capturing: bool):
    import flash_mla
    B, S_q, H, _ = q.shape
    key = (str(q.device), B, S_q, H, topk, block_size)
    meta = _METADATA.get(key)
    if meta is None:
        meta = flash_mla.get_mla_metadata()[0]
        if not capturing:       # built inside a capture, it would live in the graph's memory
            _METADATA[key] = meta
    return meta


def model1_indices(indices: torch.Tensor, n: int) -> torch.Tensor:
    """The op's indices int32 [B, S_q, topk] -> FlashMLA's: padded with -1 to a multiple of
    64 slots, and every index outside [0, ``n``) made -1 (FlashMLA would read it out of
    bounds). A flat slot's FlashMLA index is the slot itself (see the module's docstring)."""
    pad = -indices.shape[-1] % TOPK_MULTIPLE
    if pad:
        indices = torch.nn.functional.pad(indices, (0, pad), value=-1)
    return torch.where((indices >= -1) & (indices < n), indices, -1).to(torch.int32)


def prepare(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
            block_size: int = BLOCK_SIZE) -> Prepared:
    """The cache (:func:`converted`), the indices (:func:`model1_indices`) and the scheduler
    metadata of this shape, for :func:`call`. kv is the project's FP8 cache uint8 [N, 584]."""
    idx = model1_indices(indices, kv.shape[0])
    return Prepared(converted(kv, block_size), idx,
                    _metadata(q, idx.shape[-1], block_size, runtime.is_capturing(q)))


def call(q: torch.Tensor, prep: Prepared, sink: torch.Tensor | None, scale: float):
    """``flash_mla.flash_mla_with_kvcache`` in sparse FP8 mode -> FlashMLA's own
    (out bf16 [B, S_q, H, 512], lse fp32 [B, H, S_q] without the sink, +inf where no slot)."""
    import flash_mla
    return flash_mla.flash_mla_with_kvcache(
        q, prep.kcache, None, None, DIM, prep.meta, None, scale, False, True,
        indices=prep.indices, attn_sink=sink)


def to_op_lse(lse: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """FlashMLA's lse [B, H, S_q] -> the op's [B, S_q, H]: the sink added to the denominator,
    and a row with no valid slot (FlashMLA's +inf) -inf, or the sink."""
    lse = lse.transpose(1, 2)
    empty = lse == float("inf")
    if sink is None:
        return lse.masked_fill(empty, float("-inf")).contiguous()
    s = sink.to(torch.float32).expand_as(lse)
    return torch.where(empty, s, torch.logaddexp(lse, s)).contiguous()


def _check_shape(q, indices, d_v, fp8):
    B, S_q, H, D = q.shape
    if not fp8:
        raise ValueError("backend 'flash_mla' takes the FP8 cache (uint8 [N, 584]) only")
    if q.dtype != torch.bfloat16:
        raise ValueError(f"backend 'flash_mla' takes a bf16 q; got {q.dtype}")
    if H != HEADS:
        raise ValueError(f"backend 'flash_mla' takes q with {HEADS} heads (FlashMLA's MODEL1 "
                         f"64-head kernel); got q {tuple(q.shape)}")
    if D != DIM or d_v != DIM:
        raise ValueError(f"backend 'flash_mla' takes D = d_v = {DIM}; got D {D}, d_v {d_v}")


@backends.register(OP, "flash_mla", kind="external", priority=30, formats=("fp8",),
                   min_capability=CAPABILITIES[0], max_capability=CAPABILITIES[1],
                   interpreter=False, auto=False, requires=_import_failure,
                   description="FlashMLA's sparse FP8 decode (external, sm_90a/sm_100f, "
                               "64 heads, the MODEL1 layout)")
def sparse_mla_decode_flash_mla(q, kv_flat, indices, *, d_v, scale, sink, fp8):
    """FlashMLA's sparse FP8 decode on the project's cache, converted to its MODEL1 layout once."""
    _check_shape(q, indices, d_v, fp8)
    q = q.contiguous()
    out, lse = call(q, prepare(q, kv_flat, indices), sink, scale)
    return out, to_op_lse(lse, sink)
