"""PLACEHOLDER: being written."""
def indexer_logits(*a, **k):
    raise NotImplementedError("indexer_logits")


def indexer_topk(*a, **k):
    raise NotImplementedError("indexer_topk")


def to_cache_slots(*a, **k):
    raise NotImplementedError("to_cache_slots")


