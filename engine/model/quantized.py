"""The GGUF file's quantized weights, kept as the file holds them, for the CPU.

A BlockLinear multiplies by a projection's blocks as llama.cpp stores them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K):
engine/kernels/csrc/cpu/block_matmul.cpp decodes each block to exactly the float32 weights gguf's dequantization gives
and sums in float32, in an order that does not depend on the batch. So these layers compute the float32 model's products
(its weights bit for bit) at every row count, reading a quarter (Q4) to a half (Q8) of bfloat16's bytes.
--batch-invariant runs the other linear layers through the same op, their float weights as F32 or BF16 "blocks".

An Int16BlockLinear, the default where the CPU has AVX-512 VNNI or AVX2 (the same bits from either), multiplies through
engine/kernels/csrc/cpu/int16_matmul.cpp: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K blocks (the same codes and scales,
reordered once into about the file's bytes, so a step reads what the file holds) times
the activations rounded to 16-bit integers per 32 inputs, summed in integers, as llama.cpp does with 8 bits. It is
faster than the float32 path at every row count (docs/performance.md, Kernels), and as batch-independent: a row's
rounding and each output's order of sums are its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels.availability import builds
from engine.kernels.cpu_ops import load_cpu_extension
from engine.model.direct_call import DirectCall
from engine.model.output_buffer import OutputBuffer

# ggml's type ids (gguf.GGMLQuantizationType) of the quantized formats the C++ op decodes: weights, bytes per block.
QUANTIZED_TYPES: dict[int, tuple[int, int]] = {
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
}
# The formats the int16-activation op takes: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, in tiles of this many output
# rows.
INT16_TYPES = {2, 3, 6, 8, 12, 13, 14}
INT16_TILE = 16
# Float weights the op also takes, as ggml names them.
FLOAT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}


@dataclass
class Blocks:
    """One tensor as the file stores it: `data` [rows, bytes per row] of ggml type `type`, `cols` weights a row."""

    type: int
    data: torch.Tensor  # uint8
    cols: int

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @classmethod
    def of_dense(cls, weight: torch.Tensor) -> Blocks:
        """A float weight [rows, cols] as blocks of its own dtype, sharing its memory (a tied weight stays tied)."""
        w = weight.detach().contiguous()
        return cls(FLOAT_TYPES[w.dtype], w.view(torch.uint8), w.shape[1])


def _ops():
    return load_cpu_extension("orcinus_cpu_block_matmul")


def _int16_ops():
    return load_cpu_extension("orcinus_cpu_int16_matmul")


def can_use_int16(device: torch.device) -> bool:
    """The int16-activation op here: on a CPU with AVX-512 VNNI or AVX2, where it builds."""
    return (
        device.type == "cpu"
        and builds(_int16_ops, "the int16-activation block matmul is unusable here")
        and _int16_ops().available()
    )


def int16_build_isa() -> str:
    """The instructions the int16-activation op was built for ("AVX-512 VNNI", "AVX2"; "": it has none)."""
    return _int16_ops().isa()


def can_use_blocks(device: torch.device) -> bool:
    """The op here: on the CPU, where it builds (a warning says why not, if it cannot)."""
    return device.type == "cpu" and builds(_ops, "the GGUF block matmul is unusable here, using dense weights")


def dequantize(blocks: Blocks) -> torch.Tensor:
    """The weights [rows, cols] the blocks hold, in float32: gguf's own dequantization, bit for bit."""
    return _ops().block_dequantize(blocks.data, blocks.type, blocks.cols)


class BlockLinear(DirectCall):
    """A linear layer over blocks: its output features are the parts' rows, in order (a fused Q/K/V may join tensors
    stored in different types), plus the bias if there is one."""

    def __init__(self, parts: list[Blocks], bias: torch.Tensor | None = None):
        super().__init__()
        self.types = [p.type for p in parts]
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        if any(p.cols != self.in_features for p in parts):
            raise ValueError("the parts of one BlockLinear must share their input width")
        for i, p in enumerate(parts):
            self.register_buffer(f"blocks{i}", p.data, persistent=False)
        # The same tensors as a plain list: looked up by name on each of a decode step's many calls they showed in a
        # batch-1 step's profile. Blocks stay on the CPU and are never cast, so the two cannot part.
        self._parts = [p.data for p in parts]
        self.bias = bias
        self.output: OutputBuffer | None = None  # set where the outputs are too large for malloc to recycle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # a reshape costs a microsecond even where it changes nothing
            x = x.reshape(-1, self.in_features)
        out = None if self.output is None else self.output.take(x, x.shape[0], self.out_features)
        out = self._matmul(x, out)  # all parts in one call: one parallel region for the layer, not one per part
        return out if self.bias is None else out.add_(self.bias)

    def _matmul(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T into `out` (None: a new tensor), which it returns."""
        if out is None:
            out = x.new_empty(x.shape[0], self.out_features)
        _ops().block_matmul_out(x, self._parts, self.types, out)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, types={self.types}"


class Int16BlockLinear(BlockLinear):
    """A BlockLinear over INT16_TYPES parts (whole tiles of INT16_TILE rows) that rounds its input to int16 per 32
    values and sums in integers. It holds the file's blocks repacked for the op (`pack`, its `types` the packed ones),
    not a second copy."""

    def __init__(self, parts: list[Blocks], bias: torch.Tensor | None = None):
        ops = _int16_ops()
        super().__init__(
            [Blocks(ops.packed_type(p.type), ops.pack(p.data, p.type, p.cols), p.cols) for p in parts], bias
        )
        self._op = ops.int16_matmul  # bound once: it runs a few hundred times a decode step

    def _matmul(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return self._op(x, self._parts, self.types, out)  # allocated in C++ where out is None: cheaper


def use_block_weights(
    model: nn.Module, blocks: dict[str, Blocks], dense_too: bool = False, int16: bool = False
) -> set[str]:
    """Swap every linear layer whose checkpoint tensors (its Decoder.sources(), untransformed) are all in `blocks`
    (keyed by Hugging Face name) for a BlockLinear over them, in place: a fused Q/K/V joins its three; with `int16`
    an Int16BlockLinear where every part's format allows. With `dense_too` the other linear layers as well, over their
    float weights (call after the final dtype cast then). Returns the names of the weights swapped for blocks."""
    by_name = {k.removeprefix("model."): v for k, v in blocks.items()}
    swapped = set()
    for name, source in model.sources().items():
        path, _, leaf = name.rpartition(".")
        owner_path, _, attr = path.rpartition(".")
        owner = model.get_submodule(owner_path)
        layer = getattr(owner, attr)
        if leaf != "weight" or not isinstance(layer, nn.Linear):
            continue  # norms, the embedding, and layers swapped already
        if source.transform is None and all(n in by_name for n in source.names):
            parts = [by_name[n] for n in source.names]
            fits = all(p.type in INT16_TYPES and p.rows % INT16_TILE == 0 for p in parts)
            kind = Int16BlockLinear if int16 and fits else BlockLinear
            setattr(owner, attr, kind(parts, layer.bias))
            swapped.add(name)
        elif dense_too:
            setattr(owner, attr, BlockLinear([Blocks.of_dense(layer.weight)], layer.bias))
    return swapped
