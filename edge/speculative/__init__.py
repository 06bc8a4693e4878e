"""Speculative decoding at batch 1: propose k tokens cheaply, score them in one forward
of the target over the paged KV, keep the exact prefix (greedy) or the accepted prefix
by the standard accept/reject rule (sampled), roll the rest back by length.

``params.py``: the request's choice (method, k); ``proposers.py``: prompt lookup and
draft model behind one interface; ``verify.py``: the verify step, acceptance and
rollback; ``decoding.py``: one request's speculative state (proposer, adaptive k, stats).
"""
