"""The model and its numerics: the decoder interface and its families, checkpoint loading, the tokenizer, the sampler.

Uses core (shapes, requests) and attention; the tokenizer and model_files import without torch.
"""
