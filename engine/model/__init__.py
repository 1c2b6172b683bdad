"""The model and its numerics: the Llama decoder, checkpoint loading, the tokenizer and the sampler.

Uses core (shapes, requests) and attention; the tokenizer and model_files import without torch.
"""
