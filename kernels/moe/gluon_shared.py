"""What :mod:`.mma_sm90` and :mod:`.gemv_sm90` share: the nibble decode, E4M3 bits, SwiGLU.

An E2M1 nibble ``s e1 e0 m`` as the e5m2 byte ``s 000 e1 e0 m 0`` reads ``value * 2**-14``
exactly (subnormals included), converted to fp16 by the hardware (sm_89 and newer).
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
    """E4M3 scale bytes (uint8) -> fp16 ``value * 2**-8``, exactly (bits s 0eeee mmm0000000)."""
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
