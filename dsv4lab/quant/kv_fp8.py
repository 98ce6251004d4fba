"""The 584-byte FP8 KV cache layout of DeepSeek-V4 (FlashMLA's V4 layout).

One token's latent vector is 512 values: 448 "nope" values and 64 RoPE values. In the
cache it takes 584 bytes:

=========  ==========================================================================
bytes      content
=========  ==========================================================================
0..447     the 448 nope values as float8 e4m3 (after dividing by their block's scale)
448..575   the 64 RoPE values as bf16 (little-endian, two bytes each), not quantised
576..582   seven ue8m0 scales, one per 64 nope values: byte s means 2**(s - 127)
583        zero (padding to a multiple of 8 bytes)
=========  ==========================================================================

Each scale is the smallest power of two with ``amax(block) / scale <= 448`` (e4m3's
largest finite value), so nothing clips; the elements round to nearest even. A scale byte
is 0..254: 255 is ue8m0's NaN, which :func:`pack_kv_fp8` never writes and
:func:`unpack_kv_fp8` (and ``sparse_mla_decode`` with ``validate``) refuses. Against bf16's
1024 bytes a token this reads 43% fewer bytes, which is what the decode kernels are bound
by at small batch; they read this layout and dequantise it on the fly
(dsv4lab/kernels/attention).

Explained in notebooks/02_mma_attention.ipynb.
"""
from __future__ import annotations

import torch

from dsv4lab import runtime

KV_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
SCALE_BLOCK = 64
N_SCALES = NOPE_DIM // SCALE_BLOCK          # 7
ROW_BYTES = NOPE_DIM + 2 * ROPE_DIM + N_SCALES + 1   # 584
E4M3_MAX = 448.0
MAX_ABS = 2.0 ** 127        # above, an e4m3 value rounded up times its scale overflows fp32
SCALES = slice(NOPE_DIM + 2 * ROPE_DIM, ROW_BYTES - 1)   # bytes 576..582
NAN_SCALE = 255                                        # ue8m0's NaN


def nan_scale_message(name: str, row: int | None = None) -> str:
    """The ValueError's text for a scale byte 255 in ``name`` (its ``row``, when known)."""
    where = f" in row {row}" if row is not None else ""
    return f"{name} has a scale byte of 255 (ue8m0 NaN){where}: not a valid FP8 KV row"


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) for x > 0, exactly (frexp, no float log rounding)."""
    mant, exp = torch.frexp(x)               # x = mant * 2**exp, mant in [0.5, 1)
    return torch.where(mant == 0.5, exp - 1, exp)


def pack_kv_fp8(kv: torch.Tensor) -> torch.Tensor:
    """Quantise latent KV vectors [..., 512] into the 584-byte FP8 layout -> uint8 [..., 584].

    ``kv`` is bf16, fp16 or fp32 with finite values; leading dimensions (tokens, or
    pages x page_size) are kept. Explained in notebooks/02_mma_attention.ipynb.
    """
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"kv must be bf16, fp16 or fp32, got {kv.dtype}")
    if kv.dim() < 1 or kv.shape[-1] != KV_DIM:
        raise ValueError(f"kv must have shape [..., {KV_DIM}] (448 nope + 64 RoPE), got {tuple(kv.shape)}")
    x = kv.float()
    # The value checks read the tensor on the host (once): skipped inside CUDA-graph capture.
    if x.numel() and not runtime.is_capturing(x):
        nonfinite, too_big = torch.stack([~torch.isfinite(x).all(),
                                          x.abs().amax() > MAX_ABS]).tolist()
        if nonfinite:
            raise ValueError("kv contains NaN or Inf; the FP8 cache can only hold finite values")
        if too_big:
            raise ValueError("kv has values above 2^127 (~1.7e38) in magnitude: e4m3 times its "
                             "power-of-two scale (and the bf16 RoPE part) would overflow")
    lead = x.shape[:-1]
    nope = x[..., :NOPE_DIM].reshape(*lead, N_SCALES, SCALE_BLOCK)
    amax = nope.abs().amax(dim=-1)
    e = torch.where(amax > 0, _ceil_log2(amax / E4M3_MAX), torch.zeros_like(amax, dtype=torch.int32))
    e = e.clamp(-127, 127)                  # a scale byte 0..254: never 255 (NaN)
    scale = torch.ldexp(torch.ones_like(amax), e)
    q = (nope / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch.zeros(*lead, ROW_BYTES, dtype=torch.uint8, device=kv.device)
    out[..., :NOPE_DIM] = q.reshape(*lead, NOPE_DIM).view(torch.uint8)
    rope = x[..., NOPE_DIM:].to(torch.bfloat16).contiguous()
    out[..., NOPE_DIM:NOPE_DIM + 2 * ROPE_DIM] = rope.view(torch.uint8)
    out[..., SCALES] = (e + 127).to(torch.uint8)
    return out


def unpack_kv_fp8(packed: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantise the 584-byte FP8 layout, uint8 [..., 584] -> ``dtype`` [..., 512].

    Explained in notebooks/02_mma_attention.ipynb.
    """
    if not isinstance(packed, torch.Tensor):
        raise ValueError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8 (the 584-byte FP8 KV layout), got {packed.dtype}")
    if packed.dim() < 1 or packed.shape[-1] != ROW_BYTES:
        raise ValueError(f"packed must have shape [..., {ROW_BYTES}], got {tuple(packed.shape)}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be bf16, fp16 or fp32, got {dtype}")
    p = packed.contiguous()
    lead = p.shape[:-1]
    s = p[..., SCALES]
    if (s == NAN_SCALE).any():
        raise ValueError(nan_scale_message("packed"))
    nope = p[..., :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float()
    scale = torch.ldexp(torch.ones(s.shape, device=p.device), s.to(torch.int32) - 127)
    nope = (nope.reshape(*lead, N_SCALES, SCALE_BLOCK) * scale[..., None]).reshape(*lead, NOPE_DIM)
    rope = p[..., NOPE_DIM:NOPE_DIM + 2 * ROPE_DIM].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=-1).to(dtype)
