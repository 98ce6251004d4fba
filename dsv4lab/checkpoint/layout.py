"""The released checkpoint's tensors: names, shapes, dtypes, and where each goes in dsv4lab.model.

A :class:`Slot` is one piece of a module (a norm's weight, a projection, the routed experts)
with the checkpoint tensors that hold it (:class:`Spec`: name, shape, kind). The reader and
the writer share the slots, so the mapping is written once (the table is in
:mod:`dsv4lab.checkpoint`'s docstring). Kinds, their accepted dtypes and what the writer
stores (the released checkpoint's dtypes):

============  ====================================  =====================================
kind          accepted                              written
============  ====================================  =====================================
float         bfloat16, float16, float32            bfloat16
fp32          bfloat16, float16, float32            float32 (ape, sinks, mHC, router bias)
fp8           float8_e4m3fn                         float8_e4m3fn
fp8_scale     float8_e8m0fnu, uint8 (E8M0), float32  float8_e8m0fnu (ue8m0)
fp4           int8, uint8 (two E2M1 a byte)          int8
e8m0          float8_e8m0fnu, uint8                 float8_e8m0fnu (MXFP4, one per 32)
e4m3_scale    float8_e4m3fn                         float8_e4m3fn (NVFP4, one per 16)
nv_global     float32 (0-d or [1])                  float32 0-d (ModelOpt weight_scale_2)
index         int32, int64                          int64 (hash routing: tid2eid)
============  ====================================  =====================================

:func:`check` validates one tensor where it is loaded, once: its dtype and shape, finite
floats, no e4m3 NaN, FP8 scales positive powers of two, no E8M0 255 (NaN), NVFP4 scales
non-negative and finite, global scales positive, routing ids in range. The decode step's
ops then run with their value checks off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from dsv4lab.config import DSV4Config, LayerFormats
from dsv4lab.model import BlockScaledFP8Linear
from dsv4lab.model.cache import compress_overlap

E8M0 = torch.float8_e8m0fnu
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
ACCEPT = {"float": FLOATS, "fp32": FLOATS, "fp8": (torch.float8_e4m3fn,),
          "fp8_scale": (E8M0, torch.uint8, torch.float32), "fp4": (torch.int8, torch.uint8),
          "e8m0": (E8M0, torch.uint8), "e4m3_scale": (torch.float8_e4m3fn,), "nv_global": (torch.float32,),
          "index": (torch.int32, torch.int64)}
STORE = {"float": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn, "fp8_scale": E8M0,
         "fp4": torch.int8, "e8m0": E8M0, "e4m3_scale": torch.float8_e4m3fn, "nv_global": torch.float32,
         "index": torch.int64}


class CheckpointError(ValueError):
    """A checkpoint dsv4lab cannot read: the message names the tensor (or file) and why."""


@dataclass(frozen=True)
class Spec:
    """One checkpoint tensor: its name, shape and kind (the dtypes it may have)."""
    name: str
    shape: tuple
    kind: str
    optional: bool = False          # read when present, not required (ModelOpt's input_scale)
    high: int = 0                   # index tensors: ids lie in [0, high)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- validation ---------------------------------------------------------------------------------

def _as_e8m0_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == E8M0 else t


def check(spec: Spec, t: torch.Tensor, where: str = "") -> torch.Tensor:
    """``t`` checked against ``spec`` (module docstring); returns it (E8M0 and int8 as uint8
    bytes, FP8 scales as fp32, ids as int32). CheckpointError naming the tensor otherwise."""
    name = spec.name + (f" ({where})" if where else "")
    if t.dtype not in ACCEPT[spec.kind]:
        want = ", ".join(str(d).replace("torch.", "") for d in ACCEPT[spec.kind])
        raise CheckpointError(f"{name}: dtype {str(t.dtype).replace('torch.', '')}, expected {want} "
                              f"({spec.kind} tensor)")
    shape = tuple(t.shape)
    if spec.kind == "nv_global":
        ok = shape in ((), (1,))
    else:
        ok = shape == tuple(spec.shape)
    if not ok:
        raise CheckpointError(f"{name}: shape {list(shape)}, expected {list(spec.shape)}")

    def bad(msg):
        raise CheckpointError(f"{name}: {msg}")

    k = spec.kind
    if k in ("float", "fp32"):
        if not bool(torch.isfinite(t).all()):
            bad("has NaN or Inf values")
        return t
    if k == "fp8":
        if bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
            bad("holds the e4m3 NaN encoding (0x7F / 0xFF)")
        return t
    if k == "fp8_scale":
        if t.dtype == torch.float32:
            if not bool((torch.isfinite(t) & (t > 0)).all()):
                bad("FP8 block scales must be finite and positive")
            if not bool((torch.frexp(t).mantissa == 0.5).all()):
                bad("FP8 block scales must be powers of two (ue8m0), as the released checkpoint's are")
            return t
        b = _as_e8m0_bytes(t)
        if bool((b == 255).any()):
            bad("holds 255, the E8M0 NaN encoding")
        return torch.exp2(b.float() - 127.0)
    if k == "fp4":
        return t.view(torch.uint8)
    if k == "e8m0":
        b = _as_e8m0_bytes(t)
        if bool((b == 255).any()):
            bad("holds 255, the E8M0 NaN encoding")
        return b
    if k == "e4m3_scale":
        f = t.float()
        if not bool((torch.isfinite(f) & (f >= 0)).all()):
            bad("NVFP4 block scales must be finite and non-negative")
        return t
    if k == "nv_global":
        if not bool((torch.isfinite(t) & (t > 0)).all()):
            bad("the NVFP4 global scale must be finite and positive")
        return t.reshape(())
    if spec.high and bool(((t < 0) | (t >= spec.high)).any()):
        bad(f"routing ids must lie in [0, {spec.high}), got values in [{int(t.min())}, {int(t.max())}]")
    return t.to(torch.int32)


# ---- slots: one piece of a module, the tensors that hold it ---------------------------------------

Getter = Callable[[Spec], torch.Tensor]


def _resolve(root: nn.Module, path: str):
    *owners, attr = path.split(".")
    m = root
    for o in owners:
        m = getattr(m, o)
    return m, attr


def _put(root: nn.Module, path: str, t: torch.Tensor) -> None:
    """Install ``t`` at ``path`` (a parameter keeps being one, without gradient; else a buffer)."""
    m, attr = _resolve(root, path)
    if attr in m._parameters:
        m._parameters[attr] = nn.Parameter(t, requires_grad=False)
    else:
        m._buffers.pop(attr, None)
        m.__dict__.pop(attr, None)
        m.register_buffer(attr, t)


def _module(root: nn.Module, path: str) -> nn.Module:
    m = root
    for o in filter(None, path.split(".")):
        m = getattr(m, o)
    return m


def _get(root: nn.Module, path: str) -> torch.Tensor:
    m, attr = _resolve(root, path)
    return getattr(m, attr).detach()


class Slot:
    """A piece of a module and the checkpoint tensors holding it."""

    def specs(self) -> list[Spec]:
        raise NotImplementedError

    def read(self, root: nn.Module, get: Getter) -> None:
        """Install the tensors ``get(spec)`` (already checked) into ``root``."""
        raise NotImplementedError

    def write(self, root: nn.Module) -> dict:
        """{checkpoint name: tensor in its stored dtype} from ``root``."""
        raise NotImplementedError


@dataclass
class Stored(Slot):
    """A parameter or buffer stored as it is (a norm's weight, an ape, a sink)."""
    name: str
    path: str
    shape: tuple
    kind: str = "float"
    high: int = 0

    def specs(self):
        return [Spec(self.name, tuple(self.shape), self.kind, high=self.high)]

    def read(self, root, get):
        _put(root, self.path, get(self.specs()[0]))

    def write(self, root):
        return {self.name: _get(root, self.path).to(STORE[self.kind])}


def _linear_specs(name: str, N: int, K: int, fp8: bool) -> list[Spec]:
    if not fp8:
        return [Spec(f"{name}.weight", (N, K), "float")]
    return [Spec(f"{name}.weight", (N, K), "fp8"), Spec(f"{name}.scale", (_cdiv(N, 128), _cdiv(K, 128)), "fp8_scale")]


def _read_linear(get, specs, fp8: bool) -> nn.Module:
    if fp8:
        return BlockScaledFP8Linear(get(specs[0]), get(specs[1]))
    w = get(specs[0])
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    return lin


def _write_linear(mod: nn.Module, name: str, fp8: bool) -> dict:
    if fp8 != isinstance(mod, BlockScaledFP8Linear):
        raise CheckpointError(f"{name}: the model's projection is {'fp8' if not fp8 else 'bf16'}, the "
                              f"checkpoint's format says {'fp8' if fp8 else 'bf16'}")
    if fp8:
        sc = mod.weight_scale.detach().float()
        if not bool((torch.frexp(sc).mantissa == 0.5).all()):
            raise CheckpointError(f"{name}: its block scales are not powers of two (the released ue8m0 format)")
        return {f"{name}.weight": mod.weight.detach(),
                f"{name}.scale": (torch.log2(sc).round() + 127).to(torch.uint8).view(E8M0)}
    return {f"{name}.weight": mod.weight.detach().to(torch.bfloat16)}


@dataclass
class Linear(Slot):
    """A dense projection ``[N, K]``: FP8 weight + ``.scale`` or a bf16 ``.weight``."""
    name: str
    path: str
    N: int
    K: int
    fp8: bool

    def specs(self):
        return _linear_specs(self.name, self.N, self.K, self.fp8)

    def read(self, root, get):
        m, attr = _resolve(root, self.path)
        setattr(m, attr, _read_linear(get, self.specs(), self.fp8))

    def write(self, root):
        return _write_linear(_module(root, self.path), self.name, self.fp8)


@dataclass
class GroupedOut(Slot):
    """The grouped output projection: one ``[G * o_lora, H/G * D]`` weight in the checkpoint
    (group g its rows g*o_lora..); dsv4lab's bf16 form is ``[G, o_lora, H/G * D]``."""
    name: str
    path: str
    G: int
    R: int
    K: int
    fp8: bool

    def specs(self):
        return _linear_specs(self.name, self.G * self.R, self.K, self.fp8)

    def read(self, root, get):
        m, attr = _resolve(root, self.path)
        m._parameters.pop(attr, None)
        mod = _read_linear(get, self.specs(), self.fp8)
        if self.fp8:
            setattr(m, attr, mod)
        else:
            setattr(m, attr, nn.Parameter(mod.weight.view(self.G, self.R, self.K), requires_grad=False))

    def write(self, root):
        m, attr = _resolve(root, self.path)
        w = getattr(m, attr)
        if isinstance(w, nn.Parameter):
            if self.fp8:
                raise CheckpointError(f"{self.name}: the model's projection is bf16, the checkpoint's format says fp8")
            return {f"{self.name}.weight": w.detach().reshape(self.G * self.R, self.K).to(torch.bfloat16)}
        return _write_linear(w, self.name, self.fp8)


@dataclass
class SharedExpert(Slot):
    """The shared expert: ``w1`` (gate), ``w3`` (up), ``w2`` (down) projections."""
    name: str
    path: str
    d: int
    inter: int
    fp8: bool

    def _parts(self):
        return (("w1", self.inter, self.d), ("w3", self.inter, self.d), ("w2", self.d, self.inter))

    def specs(self):
        return [s for w, N, K in self._parts() for s in _linear_specs(f"{self.name}.{w}", N, K, self.fp8)]

    def read(self, root, get):
        mods = [_read_linear(get, _linear_specs(f"{self.name}.{w}", N, K, self.fp8), self.fp8)
                for w, N, K in self._parts()]
        _module(root, self.path).set_projections(*mods)

    def write(self, root):
        mlp = _module(root, self.path)
        out = {}
        for (w, _, _), mod in zip(self._parts(), mlp.projections()):
            out.update(_write_linear(mod, f"{self.name}.{w}", self.fp8))
        return out


@dataclass
class Experts(Slot):
    """The routed experts ``experts.{e}.w1|w3|w2`` of one layer, stacked into the MoE's
    ``w13 [E, 2I, ..]`` (w1 rows, then w3 rows) and ``w2 [E, d, ..]`` in ``fmt``: "mxfp4"
    (``.weight`` + E8M0 ``.scale``), "nvfp4" (ModelOpt: ``.weight``, e4m3 ``.weight_scale``,
    fp32 ``.weight_scale_2``; w1 and w3 of an expert share one global) or "bf16"."""
    name: str
    path: str
    E: int
    d: int
    inter: int
    fmt: str

    def _expert(self, e):
        return ((f"{self.name}.{e}.w1", self.inter, self.d), (f"{self.name}.{e}.w3", self.inter, self.d),
                (f"{self.name}.{e}.w2", self.d, self.inter))

    def _specs(self, n, N, K):
        if self.fmt == "bf16":
            return [Spec(f"{n}.weight", (N, K), "float")]
        if self.fmt == "mxfp4":
            return [Spec(f"{n}.weight", (N, K // 2), "fp4"), Spec(f"{n}.scale", (N, K // 32), "e8m0")]
        return [Spec(f"{n}.weight", (N, K // 2), "fp4"), Spec(f"{n}.weight_scale", (N, K // 16), "e4m3_scale"),
                Spec(f"{n}.weight_scale_2", (), "nv_global"), Spec(f"{n}.input_scale", (), "nv_global", True)]

    def specs(self):
        return [s for e in range(self.E) for n, N, K in self._expert(e) for s in self._specs(n, N, K)]

    def read(self, root, get):
        moe = _module(root, self.path)
        w13, s13, g13, w2, s2, g2 = [], [], [], [], [], []
        for e in range(self.E):
            (n1, N1, K1), (n3, _, _), (n2, N2, K2) = self._expert(e)
            a, b, c = (self._specs(n1, N1, K1), self._specs(n3, N1, K1), self._specs(n2, N2, K2))
            w13.append(torch.cat([get(a[0]), get(b[0])]))
            w2.append(get(c[0]))
            if self.fmt != "bf16":
                s13.append(torch.cat([get(a[1]), get(b[1])]))
                s2.append(get(c[1]))
            if self.fmt == "nvfp4":
                ga, gb = get(a[2]), get(b[2])
                if not torch.equal(ga, gb):
                    raise CheckpointError(
                        f"{a[2].name} ({float(ga):.6g}) and {b[2].name} ({float(gb):.6g}) differ: dsv4lab's MoE "
                        "takes one NVFP4 global scale per expert for its fused gate/up weight (unsupported format)")
                g13.append(ga)
                g2.append(get(c[2]))
        if moe.fmt != "bf16":
            raise CheckpointError(f"{self.name}: the MoE to fill must be built with bf16 experts, got {moe.fmt}")
        if self.fmt == "bf16":
            moe.w13 = nn.Parameter(torch.stack(w13), requires_grad=False)
            moe.w2 = nn.Parameter(torch.stack(w2), requires_grad=False)
            return
        glob = (torch.stack(g13), torch.stack(g2)) if self.fmt == "nvfp4" else (None, None)
        moe._set_quantized(self.fmt, torch.stack(w13), torch.stack(s13), torch.stack(w2), torch.stack(s2), *glob)

    def write(self, root):
        moe = _module(root, self.path)
        if moe.fmt != self.fmt:
            raise CheckpointError(f"{self.name}: the model's experts are {moe.fmt}, the checkpoint's format "
                                  f"says {self.fmt}")
        I, out = self.inter, {}
        for e in range(self.E):
            (n1, _, _), (n3, _, _), (n2, _, _) = self._expert(e)
            if self.fmt == "bf16":
                for n, w in ((n1, moe.w13[e, :I]), (n3, moe.w13[e, I:]), (n2, moe.w2[e])):
                    out[f"{n}.weight"] = w.detach().to(torch.bfloat16)
                continue
            pieces = ((n1, moe.w13[e, :I], moe.w13_scale[e, :I]), (n3, moe.w13[e, I:], moe.w13_scale[e, I:]),
                      (n2, moe.w2[e], moe.w2_scale[e]))
            for j, (n, w, s) in enumerate(pieces):
                out[f"{n}.weight"] = w.contiguous().view(torch.int8) if self.fmt == "mxfp4" else w.contiguous()
                if self.fmt == "mxfp4":
                    out[f"{n}.scale"] = s.contiguous().view(E8M0)
                else:
                    g = moe.w2_global if j == 2 else moe.w13_global
                    out[f"{n}.weight_scale"] = s.contiguous()
                    out[f"{n}.weight_scale_2"] = (g if g.dim() == 0 else g[e]).detach().float().reshape(())
        return out


@dataclass
class HCHeadSlot(Slot):
    """The final stream reduction: ``hc_head_fn [n, n*d]``, ``hc_head_base [n]`` and
    ``hc_head_scale [1]``; the scale multiplies the mixes, so it is folded into ``fn``."""
    prefix: str
    path: str
    n: int
    d: int

    def specs(self):
        p = self.prefix
        return [Spec(f"{p}hc_head_fn", (self.n, self.n * self.d), "fp32"), Spec(f"{p}hc_head_base", (self.n,), "fp32"),
                Spec(f"{p}hc_head_scale", (1,), "fp32")]

    def read(self, root, get):
        fn, base, scale = (get(s) for s in self.specs())
        _put(root, self.path + ".fn", (fn.float() * scale.float()).to(fn.dtype))
        _put(root, self.path + ".base", base)

    def write(self, root):
        fn, base, _ = self.specs()
        return {fn.name: _get(root, self.path + ".fn").float(), base.name: _get(root, self.path + ".base").float(),
                self.specs()[2].name: torch.ones(1)}


# ---- the slots of each part of the model ----------------------------------------------------------

def _compressor(prefix, path, d, out, ratio, overlap):
    wide = 2 * out if overlap else out
    return [Stored(f"{prefix}.wkv.weight", f"{path}.wkv.weight", (wide, d)),
            Stored(f"{prefix}.wgate.weight", f"{path}.wgate.weight", (wide, d)),
            Stored(f"{prefix}.ape", f"{path}.ape", (ratio, wide), "fp32"),
            Stored(f"{prefix}.norm.weight", f"{path}.norm.weight", (out,))]


def block_slots(cfg: DSV4Config, layer_id: int, formats: LayerFormats, prefix: str, path: str = "") -> list[Slot]:
    """The slots of decoder layer ``layer_id`` (checkpoint names under ``prefix``, e.g.
    "layers.3." or "mtp.0."; module paths under ``path``, e.g. "" for a Block, "block." for
    the MTP layer's)."""
    d, H, D, q = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    ratio = cfg.compress_ratios[layer_id] if layer_id < len(cfg.compress_ratios) else 0
    fp8 = formats.dense.dtype == "fp8_e4m3"
    if fp8 and formats.dense.block != (128, 128):
        raise CheckpointError(f"weight_block_size {list(formats.dense.block)}: dsv4lab reads 128x128 FP8 blocks")
    P, A = prefix, f"{path}attn"
    n = cfg.hc_mult
    mix = (2 + n) * n
    s: list[Slot] = [Stored(f"{P}attn_norm.weight", f"{path}attn_norm.weight", (d,)),
                     Stored(f"{P}ffn_norm.weight", f"{path}ffn_norm.weight", (d,))]
    for hc in ("attn", "ffn"):
        s += [Stored(f"{P}hc_{hc}_fn", f"{path}hc_{hc}.fn", (mix, n * d), "fp32"),
              Stored(f"{P}hc_{hc}_base", f"{path}hc_{hc}.base", (mix,), "fp32"),
              Stored(f"{P}hc_{hc}_scale", f"{path}hc_{hc}.scale", (3,), "fp32")]
    s += [Linear(f"{P}attn.wq_a", f"{A}.wq_a", q, d, fp8),
          Stored(f"{P}attn.q_norm.weight", f"{A}.q_norm.weight", (q,)),
          Linear(f"{P}attn.wq_b", f"{A}.wq_b", H * D, q, fp8),
          Linear(f"{P}attn.wkv", f"{A}.wkv", D, d, fp8),
          Stored(f"{P}attn.kv_norm.weight", f"{A}.kv_norm.weight", (D,)),
          Stored(f"{P}attn.attn_sink", f"{A}.attn_sink", (H,), "fp32"),
          GroupedOut(f"{P}attn.wo_a", f"{A}.wo_a", cfg.o_groups, cfg.o_lora_rank, H // cfg.o_groups * D, fp8),
          Linear(f"{P}attn.wo_b", f"{A}.wo_b", d, cfg.o_groups * cfg.o_lora_rank, fp8)]
    if ratio:
        s += _compressor(f"{P}attn.compressor", f"{A}.compressor", d, D, ratio, compress_overlap(cfg, ratio))
    if ratio == 4:
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        s += [Linear(f"{P}attn.indexer.wq_b", f"{A}.indexer.wq", Hi * Di, q, fp8),
              Stored(f"{P}attn.indexer.weights_proj.weight", f"{A}.indexer.wweights.weight", (Hi, d))]
        s += _compressor(f"{P}attn.indexer.compressor", f"{A}.indexer.compressor", d, Di, 4, compress_overlap(cfg, 4))
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    s.append(Stored(f"{P}ffn.gate.weight", f"{path}moe.gate.weight", (E, d)))
    if layer_id < cfg.n_hash_layers:
        s.append(Stored(f"{P}ffn.gate.tid2eid", f"{path}moe.tid2eid", (cfg.vocab_size, cfg.n_experts_per_tok),
                        "index", E))
    else:
        s.append(Stored(f"{P}ffn.gate.bias", f"{path}moe.bias", (E,), "fp32"))
    if cfg.n_shared_experts:
        s.append(SharedExpert(f"{P}ffn.shared_experts", f"{path}moe.shared", d, I * cfg.n_shared_experts, fp8))
    s.append(Experts(f"{P}ffn.experts", f"{path}moe", E, d, I, formats.experts))
    return s


def mtp_slots(cfg: DSV4Config, formats: LayerFormats, k: int = 0, path: str = "") -> list[Slot]:
    """The MTP layer ``k``'s slots (``mtp.{k}.``): its decoder block, the input projections and
    norms, its stream reduction and norm (embedding and head are the model's). Module paths
    under ``path`` ("" for an MTP module, "mtp.0." for a DSV4)."""
    d, P, M = cfg.hidden_size, f"mtp.{k}.", path
    fp8 = formats.dense.dtype == "fp8_e4m3"
    return block_slots(cfg, cfg.num_layers, formats, P, f"{M}block.") + [
        Stored(f"{P}enorm.weight", f"{M}enorm.weight", (d,)), Stored(f"{P}hnorm.weight", f"{M}hnorm.weight", (d,)),
        Linear(f"{P}e_proj", f"{M}e_proj", d, d, fp8), Linear(f"{P}h_proj", f"{M}h_proj", d, d, fp8),
        HCHeadSlot(P, f"{M}hc_head", cfg.hc_mult, d), Stored(f"{P}norm.weight", f"{M}norm.weight", (d,))]


def embed_slots(cfg: DSV4Config) -> list[Slot]:
    return [Stored("embed.weight", "embed.weight", (cfg.vocab_size, cfg.hidden_size))]


def head_slots(cfg: DSV4Config) -> list[Slot]:
    """The final stream reduction, norm and LM head."""
    d = cfg.hidden_size
    return [HCHeadSlot("", "hc_head", cfg.hc_mult, d), Stored("norm.weight", "norm.weight", (d,)),
            Stored("head.weight", "head.weight", (cfg.vocab_size, d))]
