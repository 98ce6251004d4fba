"""MXFP4 and NVFP4: four-bit expert weights, bit for bit.

Both formats store one E2M1 number per nibble: a sign bit (bit 3), two exponent bits and
one mantissa bit, giving the magnitudes

    code  0    1    2    3    4    5    6    7
    value 0    0.5  1    1.5  2    3    4    6

Two nibbles share a byte: element ``2i`` in the LOW nibble, ``2i+1`` in the HIGH one.
Rounding is to nearest, ties to the even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4),
and anything beyond 6 saturates to 6. The sign is kept even when the magnitude rounds to
zero, so -0.0 and -0.1 (at scale 1) both become nibble 0x8, "negative zero".

- **MXFP4** (OCP microscaling): one E8M0 scale byte per 32 elements, ``s`` meaning
  ``2**(s - 127)`` (255 is NaN). Rule "ocp" (the OCP MX spec): ``s = floor(log2(amax)) -
  2 + 127``, so the block maximum lands in [4, 8) and values above 6 clip. Rule "ceil":
  the smallest power of two with ``amax / scale <= 6`` (never clips, may waste a bit).
  An all-zero block gets scale byte 0.
- **NVFP4** (NVIDIA): one E4M3 scale per 16 elements times one fp32 global scale per
  tensor. ``global_scale`` defaults to ``amax / (448 * 6)`` (1.0 for an all-zero tensor);
  block scale = ``amax16 / (6 * global_scale)`` rounded to E4M3; a ``global_scale`` so small
  that a block scale would exceed E4M3's range (448, beyond its rounding) is refused.
  Element = E2M1(x / (block_scale * global_scale)). Dequantised value
  ``(e2m1 * block_scale) * global_scale`` (that order: the first product is exact).

Neither quantiser writes a NaN scale (E8M0 255, E4M3 0x7F / 0xFF), and both dequantisers
refuse one with a ValueError.

The quantisers work in float64, where every step except the final E2M1 rounding is
exact, so the results are bit-reproducible on any machine.

Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

import torch

__all__ = ["E2M1_VALUES", "mxfp4_quantize", "mxfp4_dequantize", "nvfp4_quantize",
           "nvfp4_dequantize", "e2m1_encode", "e2m1_decode_table"]

# magnitude of codes 0..7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between code i and i+1; at a tie the even code wins, so the comparison is
# ">" when code i is even (stay) and ">=" when code i+1 is even (move up)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MX_BLOCK = 32
NV_BLOCK = 16
E4M3_MAX = 448.0
E4M3_SATURATES = 464.0     # block scales above this do not round to 448: they would saturate
E2M1_MAX = 6.0


def e2m1_decode_table(dtype=torch.float32, device=None) -> torch.Tensor:
    """The 16 values a nibble decodes to (codes 8..15 are the negatives, 8 is -0.0)."""
    vals = list(E2M1_VALUES) + [-v for v in E2M1_VALUES]
    return torch.tensor(vals, dtype=dtype, device=device)


def _e8m0_table(device=None) -> torch.Tensor:
    vals = [2.0 ** (s - 127) for s in range(255)] + [float("nan")]
    return torch.tensor(vals, dtype=torch.float64).to(device=device, dtype=torch.float32)


def _check_float(x: torch.Tensor, name: str, block: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension (the last is K)")
    if x.shape[-1] == 0 or x.shape[-1] % block:
        raise ValueError(f"{name}: last dimension K={x.shape[-1]} must be a positive multiple of {block}")
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf; FP4 formats cannot represent them")


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 nibbles (uint8 0..15): RNE, saturating at 6."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for i, m in enumerate(_MIDPOINTS):
        up = (a > m) if i % 2 == 0 else (a >= m)
        code += up.to(torch.uint8)
    sign = torch.signbit(v).to(torch.uint8) << 3
    return code | sign


def _pack(codes: torch.Tensor) -> torch.Tensor:
    lo = codes[..., 0::2]
    hi = codes[..., 1::2]
    return (lo | (hi << 4)).contiguous()


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def mxfp4_quantize(x: torch.Tensor, *, scale_rule: str = "ocp") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., K]`` to MXFP4: ``(packed uint8 [..., K/2], scales uint8 [..., K/32])``.

    ``scale_rule`` "ocp" (floor(log2 amax) - 2, the OCP spec: may clip to 6) or "ceil"
    (smallest power of two that never clips). Explained in notebooks/04_mxfp4_moe_port.ipynb.
    """
    _check_float(x, "x", MX_BLOCK)
    if scale_rule not in ("ocp", "ceil"):
        raise ValueError(f"scale_rule must be 'ocp' or 'ceil', got {scale_rule!r}")
    shape = x.shape
    xb = x.detach().to(torch.float64).reshape(*shape[:-1], shape[-1] // MX_BLOCK, MX_BLOCK)
    amax = xb.abs().amax(dim=-1)
    # floor(log2(amax)) exactly: frexp gives amax = m * 2**e with m in [0.5, 1)
    _, e = torch.frexp(amax)
    floor_log2 = e.to(torch.int64) - 1
    p = floor_log2 - 2                       # amax / 2**p in [4, 8)
    if scale_rule == "ceil":
        over = amax / torch.exp2(p.to(torch.float64)) > E2M1_MAX
        p = p + over.to(torch.int64)
    s = torch.where(amax > 0, p + 127, torch.zeros_like(p)).clamp(0, 254)
    scale = torch.exp2((s - 127).to(torch.float64))
    codes = e2m1_encode(xb / scale.unsqueeze(-1)).reshape(shape)
    return _pack(codes), s.to(torch.uint8)


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``packed uint8 [..., K/2]`` and E8M0 ``scales uint8 [..., K/32]`` -> ``[..., K]``.

    Explained in notebooks/04_mxfp4_moe_port.ipynb.
    """
    _check_packed(packed, scales, torch.uint8, MX_BLOCK, "uint8 (E8M0)")
    if scales.numel() and bool((scales == 255).any()):
        raise ValueError("scales contain 255, the E8M0 NaN encoding")
    vals = e2m1_decode_table(device=packed.device)[_unpack(packed).long()]
    sc = _e8m0_table(packed.device)[scales.long()]
    out = vals.unflatten(-1, (-1, MX_BLOCK)) * sc.unsqueeze(-1)
    return out.flatten(-2).to(dtype)


def _check_packed(packed, scales, scale_dtype, block, scale_desc) -> None:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a uint8 tensor (two E2M1 nibbles a byte), got "
                         f"{getattr(packed, 'dtype', type(packed).__name__)}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != scale_dtype:
        raise ValueError(f"scales must be {scale_desc}, got {getattr(scales, 'dtype', type(scales).__name__)}")
    if packed.dim() < 1:
        raise ValueError("packed must have at least one dimension")
    k = packed.shape[-1] * 2
    if k == 0 or k % block:
        raise ValueError(f"packed: last dimension {packed.shape[-1]} gives K={k}, "
                         f"which must be a positive multiple of {block}")
    want = (*packed.shape[:-1], k // block)
    if tuple(scales.shape) != want:
        raise ValueError(f"scales must have shape {list(want)} (one per {block} elements), "
                         f"got {list(scales.shape)}")


def _global_scale_value(global_scale, name="global_scale") -> float:
    if isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1:
            raise ValueError(f"{name} must be a scalar (0-d tensor or float), got shape {list(global_scale.shape)}")
        g = float(global_scale.reshape(()).to(torch.float32))
    elif isinstance(global_scale, (int, float)):
        g = float(torch.tensor(float(global_scale), dtype=torch.float32))
    else:
        raise ValueError(f"{name} must be a float or a 0-d tensor, got {type(global_scale).__name__}")
    if not (g > 0 and g < float("inf")):
        raise ValueError(f"{name} must be finite and > 0, got {g}")
    return g


def nvfp4_quantize(x: torch.Tensor, *, global_scale=None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., K]`` to NVFP4.

    Returns ``(packed uint8 [..., K/2], scales float8_e4m3fn [..., K/16], global_scale fp32 0-d)``.
    A given ``global_scale`` under ``amax / (448 * 6)`` (block scales beyond E4M3's range) is a
    ValueError. Explained in notebooks/04_mxfp4_moe_port.ipynb.
    """
    _check_float(x, "x", NV_BLOCK)
    shape = x.shape
    if global_scale is None:
        amax = float(x.detach().abs().amax().to(torch.float32)) if x.numel() else 0.0
        g = float(torch.tensor(amax / (E4M3_MAX * E2M1_MAX), dtype=torch.float32))
        if not g > 0:
            g = 1.0
    else:
        g = _global_scale_value(global_scale)
    xb = x.detach().to(torch.float64).reshape(*shape[:-1], shape[-1] // NV_BLOCK, NV_BLOCK)
    amax16 = xb.abs().amax(dim=-1)
    bs = amax16 / (E2M1_MAX * g)
    if global_scale is not None and bs.numel() and float(bs.max()) > E4M3_SATURATES:
        amax = float(amax16.max())
        raise ValueError(
            f"global_scale={g:.6g} is too small for x (amax {amax:.6g}): its block scales "
            f"amax16 / (6 * global_scale) reach {float(bs.max()):.6g}, beyond E4M3's largest "
            f"value (448), and would saturate; use global_scale >= amax / (448 * 6) = "
            f"{amax / (E4M3_MAX * E2M1_MAX):.6g} (the default)")
    bs = bs.clamp(max=E4M3_MAX)
    bs8 = bs.to(torch.float32).to(torch.float8_e4m3fn)
    denom = bs8.to(torch.float64) * g
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    v = torch.where(denom.unsqueeze(-1) > 0, xb / safe.unsqueeze(-1), xb * 0.0)
    codes = e2m1_encode(v).reshape(shape)
    return _pack(codes), bs8, torch.tensor(g, dtype=torch.float32)


def nvfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale, *,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``packed uint8 [..., K/2]``, E4M3 ``scales [..., K/16]``, fp32 ``global_scale`` -> ``[..., K]``.

    Value = ``(e2m1 * block_scale) * global_scale`` in fp32. Explained in
    notebooks/04_mxfp4_moe_port.ipynb.
    """
    _check_packed(packed, scales, torch.float8_e4m3fn, NV_BLOCK, "float8_e4m3fn")
    g = _global_scale_value(global_scale)
    sc = scales.to(torch.float32)
    if sc.numel() and not bool(torch.isfinite(sc).all()):
        raise ValueError("scales contain NaN (E4M3 0x7F/0xFF)")
    vals = e2m1_decode_table(device=packed.device)[_unpack(packed).long()]
    out = (vals.unflatten(-1, (-1, NV_BLOCK)) * sc.unsqueeze(-1)) * torch.tensor(g, dtype=torch.float32)
    return out.flatten(-2).to(dtype)
