"""What the MoE's sm_90 Gluon kernels share (:mod:`.mma_sm90`, :mod:`.gemv_sm90`): the
nibble decode as an fp8 conversion, the E4M3 scale bits and the SwiGLU.

An E2M1 nibble ``s e1 e0 m`` written as the e5m2 byte ``s 000 e1 e0 m 0`` reads
``value * 2**-14`` exactly (e1 e0 the low exponent bits, bias 15; e = 0 lands on e5m2's
subnormals as E2M1's does): the same fp16 the Triton kernel's bit placement builds, here
made by the hardware's fp8 -> fp16 conversion (sm_89 and newer).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# The bit placement ($4: 4 packed bytes): the low nibbles' e5m2 bytes in l, the high
# nibbles' in h, each split into 16-bit halves (l0 l1, h0 h1) for the conversions.
CVT8_PLACE = """
.reg .b32 u, v, l, h;
.reg .b16 l0, l1, h0, h1;
shl.b32 u, $4, 4;
shl.b32 v, $4, 1;
and.b32 v, v, 0x0E0E0E0E;
lop3.b32 l, u, v, 0x80808080, 0xEC;
shr.b32 u, $4, 3;
and.b32 u, u, 0x0E0E0E0E;
lop3.b32 h, $4, u, 0x80808080, 0xEC;
mov.b32 {l0, l1}, l;
mov.b32 {h0, h1}, h;
"""


@gluon.jit
def e4m3_bits(sb):
    """E4M3 scale bytes (uint8) -> fp16 ``value * 2**-8``, exactly (the bits s eeee mmm
    placed as fp16 s 0eeee mmm0000000; times 256 gives the value)."""
    b = sb.to(gl.int16)
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return bits.to(gl.float16, bitcast=True)


@gluon.jit
def swiglu(gate, up, swiglu_limit, HAS_LIMIT: gl.constexpr):
    """silu(min(g, L)) * clamp(u, -L, L), or silu(g) * u; fp32."""
    if HAS_LIMIT:
        gate = gl.minimum(gate, swiglu_limit)
        up = gl.minimum(gl.maximum(up, -swiglu_limit), swiglu_limit)
    return gate / (1.0 + gl.exp(-gate)) * up
