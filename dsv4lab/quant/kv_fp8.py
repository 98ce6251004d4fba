"""PLACEHOLDER: being written."""
def pack_kv_fp8(*a, **k):
    raise NotImplementedError("pack_kv_fp8")


def unpack_kv_fp8(*a, **k):
    raise NotImplementedError("unpack_kv_fp8")


