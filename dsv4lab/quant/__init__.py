"""Number formats: MXFP4 and NVFP4 expert weights, and the 584-byte FP8 KV cache layout."""
from dsv4lab.quant.fp4 import mxfp4_dequantize, mxfp4_quantize, nvfp4_dequantize, nvfp4_quantize
from dsv4lab.quant.kv_fp8 import pack_kv_fp8, unpack_kv_fp8

__all__ = ["mxfp4_quantize", "mxfp4_dequantize", "nvfp4_quantize", "nvfp4_dequantize",
           "pack_kv_fp8", "unpack_kv_fp8"]
