"""Sampling: logits to tokens, per request (penalties, bias, temperature, top-k/p, min-p, seeds, logprobs), the
grammar masks of constrained requests, the verification of draft tokens, and what it all keeps per request.

Uses core (params, the token types) alone.
"""
