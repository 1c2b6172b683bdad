"""Shared fixtures: the default model loaded once, and the transformers reference loaded once."""

import pytest
import torch

from engine.loader import default_model_path, load_checkpoint

# Reference and engine share the 2 cores; fewer threads than cores avoids oversubscription stalls.
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def checkpoint():
    return load_checkpoint(None)


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    return checkpoint.tokenizer


@pytest.fixture(scope="session")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()
