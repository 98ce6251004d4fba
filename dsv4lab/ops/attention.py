"""PLACEHOLDER: being written."""
def sparse_mla_decode(*a, **k):
    raise NotImplementedError("sparse_mla_decode")


