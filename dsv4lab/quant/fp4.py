"""PLACEHOLDER: being written."""
def mxfp4_dequantize(*a, **k):
    raise NotImplementedError("mxfp4_dequantize")


def mxfp4_quantize(*a, **k):
    raise NotImplementedError("mxfp4_quantize")


def nvfp4_dequantize(*a, **k):
    raise NotImplementedError("nvfp4_dequantize")


def nvfp4_quantize(*a, **k):
    raise NotImplementedError("nvfp4_quantize")


