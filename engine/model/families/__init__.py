"""Model families: one module each (a `Decoder` subclass and its layer), and the registry that picks one.

A new family is its module and one line here; the runner, the graph runners, sharding and the pipeline stages
know models only through `engine.model.decoder`.
"""

from __future__ import annotations

from engine.core.config import ModelShape
from engine.model.decoder import Decoder
from engine.model.families.gemma2 import Gemma2Model
from engine.model.families.gemma3 import Gemma3Model
from engine.model.families.llama import LlamaModel
from engine.model.families.phi3 import Phi3Model

# ModelShape.family -> the class that builds it.
FAMILIES: dict[str, type[Decoder]] = {
    "llama": LlamaModel,
    "phi3": Phi3Model,
    "gemma2": Gemma2Model,
    "gemma3": Gemma3Model,
}


def model_class(shape: ModelShape) -> type[Decoder]:
    return FAMILIES[shape.family]
