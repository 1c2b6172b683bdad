"""The CPU attention op (engine/kernels/csrc/cpu/paged_decode_attention.cpp): it builds here, matches the PyTorch
reference on ragged decode and mixed batches in every dtype and head shape, and `auto` picks it on the CPU (or falls
back)."""

import pytest
import torch
from test_cuda_kernels import ragged_batch, rel_error

from engine.attention import cpu_backend
from engine.attention.backend import AttentionParams, write_kv
from engine.attention.cpu_backend import CpuAttention
from engine.attention.selector import make_backend
from engine.attention.torch_backend import TorchAttention

DECODE = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 33), (1, 700), (1, 2049)]
MIXED = [(1, 300), (17, 17), (1, 16), (40, 97), (1, 1), (1, 33), (40, 1100)]  # the last past 1024 keys: SDPA
# (query heads, KV heads, head dim): SmolLM2's 9/3/64, plain multi-head, Llama-1B's 32/8/64 group of 4, the
# 128-wide specialisation, and a width that takes the generic path.
SHAPES = [(9, 3, 64), (4, 4, 64), (32, 8, 64), (8, 2, 128), (6, 2, 48)]
# Float32 agrees with the reference to rounding; the others round the output once, as the reference does.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
PLAIN = AttentionParams.plain(64)


@pytest.fixture(scope="module")
def cpu():
    return CpuAttention()


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decode_matches_the_reference(cpu, shape, dtype):
    q, cache, meta = ragged_batch(DECODE, *shape, dtype=dtype, device="cpu")
    want = TorchAttention().forward(q.float(), cache.float(), meta)
    got = cpu.forward(q, cache, meta)
    assert got.dtype == dtype and got.shape == q.shape
    assert rel_error(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_batches_take_the_op_for_their_decoding_rows(cpu, dtype):
    q, cache, meta = ragged_batch(MIXED, 9, 3, 64, dtype=dtype, device="cpu")
    want = TorchAttention().forward(q.float(), cache.float(), meta)
    assert rel_error(cpu.forward(q, cache, meta), want) < TOLERANCE[dtype]


def test_a_short_prompt_s_tokens_get_the_bits_each_gets_as_a_decode_query_alone(cpu):
    """A prompt chunk with at most 1024 keys goes through the op: each of its tokens attends as a decode query at
    its position, so its output does not depend on where the prompt was cut into chunks or what else ran beside."""
    q, cache, meta = ragged_batch([(40, 97), (1, 300), (33, 1100)], 9, 3, 64, dtype=torch.float32, device="cpu")
    out = cpu.forward(q, cache, meta)
    for j in range(40):  # the chunk's j-th query sits at position 97 - 40 + j: it sees 58 + j keys
        alone = cpu._decode(
            q[j : j + 1],
            cache,
            meta.block_tables,
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([58 + j], dtype=torch.int32),
            PLAIN,
        )
        assert torch.equal(out[j : j + 1], alone)
    assert rel_error(out, TorchAttention().forward(q, cache, meta)) < 1e-5


def test_strided_queries_and_table_slices_are_read_in_place(cpu):
    """The model hands over q as a slice of the fused Q/K/V rows, and the tables cut to the longest context."""
    q, cache, meta = ragged_batch(DECODE, 9, 3, 64, dtype=torch.float32, device="cpu")
    wide = torch.randn(q.shape[0], 12, 64)
    wide[:, :9] = q
    tables = torch.cat([meta.block_tables, torch.full((len(DECODE), 5), 7, dtype=torch.int32)], dim=1)
    got = cpu._decode(wide[:, :9], cache, tables, None, meta.context_lens, PLAIN)
    want = TorchAttention._decode(q, cache, meta.block_tables, None, meta.context_lens, PLAIN)
    assert rel_error(got, want) < 1e-5


def test_bad_inputs_are_refused(cpu):
    q, cache, meta = ragged_batch(DECODE, 9, 3, 64, dtype=torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match="kv_cache must be of q's dtype"):
        cpu._decode(q.bfloat16(), cache, meta.block_tables, None, meta.context_lens, PLAIN)
    with pytest.raises(RuntimeError, match="kv_cache must be of q's dtype"):
        cpu._decode(q.double(), cache.half(), meta.block_tables, None, meta.context_lens, PLAIN)
    with pytest.raises(RuntimeError, match="int32"):
        cpu._decode(q, cache, meta.block_tables.long(), None, meta.context_lens, PLAIN)
    with pytest.raises(RuntimeError, match="head shapes"):
        cpu._decode(q[:, :8], cache, meta.block_tables, None, meta.context_lens, PLAIN)


def test_auto_picks_the_op_on_the_cpu_and_the_reference_without_it(monkeypatch):
    assert isinstance(make_backend("auto", "cpu"), CpuAttention)
    assert isinstance(make_backend("cpu"), CpuAttention)

    def no_compiler():
        raise RuntimeError("Error building extension 'orcinus_cpu_attention'")

    monkeypatch.setattr(cpu_backend, "_kernels", no_compiler)
    with pytest.warns(UserWarning, match="CPU attention kernel is unusable here"):
        backend = make_backend("auto", "cpu")
    assert type(backend) is TorchAttention


@pytest.mark.parametrize("window", [0, 20], ids=["whole", "window"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_request_s_rows_read_together_give_each_row_s_bits_alone(cpu, window, threads):
    """A decoding request verifying 8 draft tokens sends 9 rows of one request, which share their key reads; each
    row's output must be bit for bit what it gets decoded alone (greedy tokens with and without speculation)."""
    # 17 rows: 51 queries a KV head, two tasks of 25 and 26, the second starting inside a row's query heads.
    q, cache, meta = ragged_batch([(9, 300), (1, 40), (5, 77), (17, 150)], 9, 3, 64, dtype=torch.float32, device="cpu")
    params = AttentionParams(PLAIN.scale, sliding_window=window or None)
    d = meta.decode_rows()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = cpu._decode(q, cache, meta.block_tables, d.requests, d.context_lens, params)
        alone = [
            cpu._decode(
                q[r : r + 1], cache, meta.block_tables, d.requests[r : r + 1], d.context_lens[r : r + 1], params
            )
            for r in range(q.shape[0])
        ]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, torch.cat(alone))
    want = TorchAttention._decode(q, cache, meta.block_tables, d.requests, d.context_lens, params)
    assert rel_error(together, want) < 1e-5


NARROW = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_a_16_bit_cache_under_float32_queries_is_read_as_its_float32_values(cpu, shape, cache_dtype):
    """--kv-cache-dtype: the op widens the stored keys and values exactly, so it is the float32 reference over the
    same values (to float32 rounding), and its output stays float32."""
    q, cache, meta = ragged_batch(DECODE, *shape, dtype=torch.float32, device="cpu")
    narrow = cache.to(cache_dtype)
    got = cpu.forward(q, narrow, meta)
    assert got.dtype == torch.float32
    assert rel_error(got, TorchAttention().forward(q, narrow.float(), meta)) < 1e-5
    assert torch.equal(got, cpu.forward(q, narrow.float(), meta))  # the same arithmetic as a float32 cache


@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
def test_a_16_bit_cache_in_mixed_batches_and_the_reference(cpu, cache_dtype):
    """Prompts past 1024 keys (SDPA) and the PyTorch reference itself read a 16-bit cache too."""
    q, cache, meta = ragged_batch(MIXED, 9, 3, 64, dtype=torch.float32, device="cpu")
    narrow = cache.to(cache_dtype)
    want = TorchAttention().forward(q, narrow.float(), meta)
    assert rel_error(cpu.forward(q, narrow, meta), want) < 1e-5
    assert torch.equal(TorchAttention().forward(q, narrow, meta), want)


@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
def test_a_16_bit_cache_keeps_batch_invariance(cache_dtype):
    """--batch-invariant with a 16-bit cache: a prompt's tokens get the bits each gets decoded alone."""
    from engine.attention.invariant import BatchInvariantAttention

    op = BatchInvariantAttention()
    q, cache, meta = ragged_batch([(40, 1200), (1, 300), (33, 1100)], 9, 3, 64, dtype=torch.float32, device="cpu")
    narrow = cache.to(cache_dtype)
    out = op.forward(q, narrow, meta)
    for j in range(0, 40, 7):  # the chunk's j-th query sits at position 1200 - 40 + j: it sees 1161 + j keys
        lens = torch.tensor([1161 + j], dtype=torch.int32)
        alone = op._decode(q[j : j + 1], narrow, meta.block_tables, torch.tensor([0], dtype=torch.int32), lens, PLAIN)
        assert torch.equal(out[j : j + 1], alone)


@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
def test_the_kv_write_rounds_into_a_16_bit_cache(cache_dtype):
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cache = torch.zeros(2, 2, 2, 4, 8, dtype=cache_dtype)
    write_kv(k, v, cache, torch.tensor([5, 0, 2]))
    assert torch.equal(cache[0, :, 1, 1], k[0].to(cache_dtype)) and torch.equal(cache[1, :, 0, 2], v[2].to(cache_dtype))


@pytest.mark.parametrize("window", [0, 100], ids=["whole", "window"])
@pytest.mark.parametrize("shape", [(4, 1, 256), (14, 2, 64), (32, 8, 64)], ids=lambda s: "x".join(map(str, s)))
def test_a_kv_head_s_query_heads_scored_together_get_each_head_s_bits_alone(cpu, shape, window):
    """Gemma 3's 4 query heads on one KV head of 256, Qwen2.5's 7 on each of 2, Llama 3.2's 4 on each of 8, over a
    float16 cache: the heads read each key and value together (widened once for four), and each head's output is bit
    for bit what it gets as the lone query head of its KV head, in batches of decodes and of draft rows."""
    hq, hkv, d = shape
    q, cache, meta = ragged_batch(
        [(1, 300), (1, 129), (5, 77), (1, 33), (9, 210)], hq, hkv, d, dtype=torch.float32, device="cpu"
    )
    cache = cache.half()
    params = AttentionParams(d**-0.5, sliding_window=window or None)
    rows = meta.decode_rows()
    together = cpu._decode(q, cache, meta.block_tables, rows.requests, rows.context_lens, params)
    group = hq // hkv
    for h in range(hq):
        alone = cpu._decode(
            q[:, h : h + 1].contiguous(),
            cache[:, h // group : h // group + 1].contiguous(),
            meta.block_tables,
            rows.requests,
            rows.context_lens,
            params,
        )
        assert torch.equal(together[:, h : h + 1], alone), h
    want = TorchAttention._decode(q, cache.float(), meta.block_tables, rows.requests, rows.context_lens, params)
    assert rel_error(together, want) < 1e-5
