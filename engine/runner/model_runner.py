"""Runs one iteration: turns a Batch into flat tensors and returns the logits of the rows to sample."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.selector import make_backend
from engine.core.batch import PLACEHOLDER, Batch
from engine.core.config import EngineConfig
from engine.model.decoder import Decoder
from engine.runner.cuda_graphs import CudaGraphRunner
from engine.runner.decode_graphs import DecodeGraphRunner, row_requests, whole_step_rows
from engine.runner.device import num_kv_blocks
from engine.runner.input_batch import InputBatch
from engine.runner.kv_dtype import kv_dtype
from engine.runner.pooling import Pooler
from engine.runner.prompt_logprobs import DevicePromptLogprobs, PromptRows, reduce_rows
from engine.runner.token_segments import pick_segments


class StepInputs:
    """Host buffers for one iteration's inputs, pinned on a GPU so their copies are asynchronous.

    The runner keeps two and alternates: with async scheduling a step is prepared while the one before runs,
    but the one before that has been collected (its sampled ids read back), so its copies are done.
    """

    def __init__(self, config: EngineConfig, max_model_len: int, device: torch.device):
        pin = device.type == "cuda"
        max_tokens, max_seqs = config.max_num_batched_tokens, config.max_num_seqs
        max_blocks = -(-max_model_len // config.block_size)
        self.device = device

        def buf(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        self.bufs = {
            "input_ids": buf(max_tokens, torch.int64),
            "positions": buf(max_tokens, torch.int64),
            "slot_mapping": buf(max_tokens, torch.int64),
            "query_start_loc": buf(max_seqs + 1, torch.int32),
            "context_lens": buf(max_seqs, torch.int32),
            "block_tables": buf(max_seqs * max_blocks, torch.int32),
            "logits_indices": buf(max_tokens, torch.int64),  # a request verifying drafts has a row per draft
            "ahead_rows": buf(max_seqs, torch.int64),
            "row_requests": buf(max_tokens, torch.int64),
            "ahead_sources": buf(max_seqs, torch.int64),
            "prompt_rows": buf(max_tokens, torch.int64),
            "prompt_targets": buf(max_tokens, torch.int64),
        }
        self.arrays = {name: t.numpy() for name, t in self.bufs.items()}

    def put(self, name: str, values: list[int], shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Stage a flat list of `values` and start their copy to the device; returns the device tensor."""
        if self.device.type == "cpu":  # a tensor of its own (a caller may keep it): no staging, no copy after it
            host = torch.from_numpy(np.array(values, dtype=self.arrays[name].dtype))
            return host if shape is None else host.view(shape)
        n = len(values)
        self.arrays[name][:n] = values  # numpy converts the list in C: no array in between
        host = self.bufs[name][:n]
        if shape is not None:
            host = host.view(shape)
        return host.to(self.device, non_blocking=True)


def graph_max_tokens(config: EngineConfig) -> int:
    """The largest piecewise-graph bucket: by default the token budget, so every iteration replays graphs.

    Not capped below it: mixed iterations past a cap run eagerly and cost more than all the others on a GPU
    (docs/performance.md, GPU).
    """
    return config.cuda_graph_max_tokens or config.max_num_batched_tokens


class ModelRunner:
    """Owns the model, the KV cache tensors, the attention backend and (on a GPU) the CUDA graphs.

    `num_blocks=None` sizes the KV cache from the memory left once the weights are in place, less a reserve for
    the graphs, which capture after it (they write K/V into it). One block beyond `num_blocks` is the scratch
    block padded graph rows write to; the scheduler never hands it out.
    """

    def __init__(self, config: EngineConfig, model: Decoder, num_blocks: int | None, max_model_len: int):
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        s = model.shape
        self.attention = make_backend(config.attention_backend, self.device.type)
        self.inputs = [StepInputs(config, max_model_len, self.device) for _ in range(2)]
        # Each live request's block table, kept between steps: a batch brings only its changes.
        self.input_batch = InputBatch(-(-max_model_len // config.block_size), config.max_num_seqs)
        self.num_steps = 0
        # Graphs capture one whole model on one GPU: not a pipeline stage's span, nor a rank's shard, whose
        # collectives would have to be captured too.
        use_graphs = (
            self.device.type == "cuda"
            and not config.enforce_eager
            and model.is_whole
            and model.shard.size == 1
            and not config.lora_enabled  # a step's adapter mask is not captured: LoRA runs eagerly
        )
        self.num_blocks = num_blocks if num_blocks is not None else num_kv_blocks(config, s, len(model.layers))
        self.scratch_block = self.num_blocks
        self.kv_caches = [
            torch.zeros(
                2,
                s.num_kv_heads,
                self.num_blocks + 1,
                config.block_size,
                s.head_dim,
                dtype=kv_dtype(config),
                device=self.device,
            )
            for _ in model.layers  # a pipeline stage caches only its own layers
        ]
        # The last run's prompt logprobs (rows its chunks asked for), their host copy started; None if none asked.
        self.prompt_logprobs: DevicePromptLogprobs | None = None
        # The last run's final hidden states of the requests that asked for a length probe, by request id.
        self.probed_hidden: dict[str, list[float]] = {}
        # The last run's pooled prompts of the embedding requests whose last chunk ran, by request id.
        self.pooler = Pooler()
        self.pooled: dict[str, list[float]] = {}
        self.graphs: CudaGraphRunner | None = None
        self.decode_graphs: DecodeGraphRunner | None = None
        # Steps run by each path since start: a benchmark checks the path it means to time actually ran.
        self.step_paths: Counter[str] = Counter()
        self.lora = None  # the model's LoRA slots (engine/model/lora.py), set by an executor serving adapters
        segments = pick_segments(config.compile, use_graphs, model, self.kv_caches, self.scratch_block)
        if use_graphs:
            self.graphs = CudaGraphRunner(
                model,
                self.kv_caches,
                graph_max_tokens(config),
                self.scratch_block,
                self.device,
                self.dtype,
                segments=segments,
            )
        if use_graphs and getattr(self.attention, "graph_safe_decode", False):
            self.decode_graphs = DecodeGraphRunner(
                model,
                self.kv_caches,
                self.attention,
                config.max_num_seqs,
                self.scratch_block,
                self.device,
                self.graphs.capture,
                segments,
                max_rows=whole_step_rows(config),
            )

    def describe(self) -> str:
        """What really runs, from the modules built (a fused op that failed to build shows as its fallback)."""
        names = {type(m).__name__ for m in self.model.modules()}
        linears = sorted(n for n in names if n.endswith("Linear"))
        fused = sorted(n for n in names if n.startswith("Cpu"))  # the C++ token ops (engine/model/token_ops.py)
        parts = [
            self.attention.label,
            " + ".join(linears) or "no linear layers",
            f"fused {', '.join(fused)}" if fused else "PyTorch token ops",
        ]
        if self.graphs is not None:
            parts.append("CUDA graphs" + (" with whole-step graphs" if self.decode_graphs is not None else ""))
        return "; ".join(parts)

    @torch.inference_mode()
    def run(
        self,
        batch: Batch,
        hidden: torch.Tensor | None = None,
        previous: tuple[torch.Tensor, dict[str, int]] | None = None,
    ) -> torch.Tensor:
        """Logits [rows, vocab] (float32): each request that samples has `num_logits_rows`, in batch order.

        A pipeline stage takes the previous stage's `hidden` states and, unless it is the last,
        returns its own for the next. `previous` is the batch before's sampled ids on the device and each
        request's row in them: a PLACEHOLDER input reads its request's id there. Rows that asked for prompt
        logprobs get them from the same pass, left in `self.prompt_logprobs`.
        """
        input_ids, positions, meta, logits_indices = self.prepare(batch, previous)
        if self.lora is not None:
            self.lora.set_rows(batch.lora_slots, meta.query_lens_cpu)
        self.prompt_logprobs = None
        self.probed_hidden = {}
        self.pooled = {}
        prompt = PromptRows.of(batch) if self.model.is_last else None
        probes = probe_rows(batch) if self.model.is_last else {}
        pooling = self.model.is_last and Pooler.wants(batch)
        if prompt is not None or probes or pooling:
            return self._run_normed(input_ids, positions, meta, logits_indices, hidden, prompt, probes, batch)
        logits = None
        if self.decode_graphs is not None and self.decode_graphs.takes(input_ids.shape[0], len(logits_indices), meta):
            rows = self.inputs[(self.num_steps - 1) % 2].put("row_requests", row_requests(meta))
            logits = self.decode_graphs.forward(input_ids, positions, meta, rows, logits_indices)
            path = "whole"
        if logits is None and self.graphs is not None:
            logits = self.graphs.forward(input_ids, positions, meta, self.attention, logits_indices)
            path = "piecewise"
        if logits is None:
            logits = self.model(input_ids, positions, self.kv_caches, meta, self.attention, logits_indices, hidden)
            path = "eager"
        self.step_paths[path] += 1
        return logits

    def _run_normed(
        self,
        input_ids,
        positions,
        meta,
        logits_indices,
        hidden,
        prompt: PromptRows | None,
        probes: dict[str, int],
        batch: Batch,
    ):
        """The forward to the final norm for every row; then the sampled rows' logits, the prompt rows' logprobs (in
        bounded chunks) and the probed rows' hidden states."""
        normed = None
        if self.graphs is not None:
            normed = self.graphs.forward(input_ids, positions, meta, self.attention, None)
        self.step_paths["piecewise" if normed is not None else "eager"] += 1
        if normed is None:
            normed = self.model(input_ids, positions, self.kv_caches, meta, self.attention, None, hidden)
        if probes:
            states = normed[list(probes.values())].float().cpu().tolist()
            self.probed_hidden = dict(zip(probes, states))
        if Pooler.wants(batch):
            self.pooled = self.pooler.pool(batch, normed)
        if prompt is not None:
            inputs = self.inputs[(self.num_steps - 1) % 2]  # the buffers prepare() just filled
            rows, targets = inputs.put("prompt_rows", prompt.rows), inputs.put("prompt_targets", prompt.targets)
            packed = reduce_rows(self.model, normed.index_select(0, rows), targets, prompt.num_top)
            self.prompt_logprobs = DevicePromptLogprobs(packed, prompt)
        return self.model.logits(normed[logits_indices])

    def prepare(self, batch: Batch, previous: tuple[torch.Tensor, dict[str, int]] | None = None):
        """The flat inputs of `batch`: ids, positions, attention metadata and the rows whose logits are sampled.

        The batch's block-table changes go into the persistent batch first; its tables are a gather of those rows.
        """
        rows = self.input_batch.apply(batch)
        reqs, d = batch.requests, batch.decode
        if not reqs:  # plain decode rows alone: columns in, arrays out
            return self._prepare_decode(
                rows, d.request_ids, d.token_ids, self.input_batch.decode_positions, None, previous
            )
        if not d.request_ids and all(len(r.token_ids) == 1 for r in reqs):
            positions = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
            sampling = [i for i, r in enumerate(reqs) if r.sample]
            ids = [r.token_ids[0] for r in reqs]
            return self._prepare_decode(rows, [r.request_id for r in reqs], ids, positions, sampling, previous)
        bs = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        owners: list[int] = []  # each row's request, in batch order
        query_lens, context_lens, logits_indices = [], [], []
        query_start = [0]
        ahead_rows, ahead_sources = [], []  # placeholder rows, and where in `previous` their ids are
        end = 0  # rows so far
        # Per request per step, so the one-token case (decode) takes the short way.
        for i, r in enumerate(batch.requests):
            ids, start = r.token_ids, r.num_computed_tokens
            n = len(ids)
            input_ids += ids
            end += n
            if ids[-1] == PLACEHOLDER:
                input_ids[-1] = 0  # any valid id until the device's own arrives (a failed batch before sends none)
                if previous is not None and r.request_id in previous[1]:
                    ahead_rows.append(end - 1)
                    ahead_sources.append(previous[1][r.request_id])
            positions += range(start, start + n)
            owners += [i] * n
            query_lens.append(n)
            context_lens.append(start + n)
            query_start.append(end)
            if r.sample:  # its last known token's row, then each draft token's
                logits_indices += range(end - r.num_logits_rows, end)
        decode_positions = None
        if d.request_ids:  # the plain decode rows' columns, after the others
            n, first = len(d.request_ids), len(reqs)
            decode_positions = self.input_batch.decode_positions
            ids = d.token_ids
            if PLACEHOLDER in ids:
                ids = list(ids)
                for i, token in enumerate(ids):
                    if token == PLACEHOLDER:
                        ids[i] = 0  # as above
                        if previous is not None and d.request_ids[i] in previous[1]:
                            ahead_rows.append(end + i)
                            ahead_sources.append(previous[1][d.request_ids[i]])
            input_ids += ids
            owners += range(first, first + n)
            query_lens += [1] * n
            context_lens += (decode_positions + 1).tolist()
            query_start += range(end + 1, end + n + 1)
            logits_indices += range(end, end + n)
            end += n

        inputs = self.inputs[self.num_steps % 2]
        self.num_steps += 1
        put = inputs.put
        tables, max_blocks = self.input_batch.gather(rows)
        pos = np.array(positions, dtype=np.int64)
        if decode_positions is not None:
            pos = np.concatenate([pos, decode_positions])
        slots = tables[np.array(owners, dtype=np.intp), pos // bs].astype(np.int64) * bs + pos % bs
        meta = AttentionMetadata(
            query_start_loc=put("query_start_loc", query_start),
            context_lens=put("context_lens", context_lens),
            block_tables=put("block_tables", tables.ravel(), (len(rows), max_blocks)),
            slot_mapping=put("slot_mapping", slots),
            query_lens_cpu=query_lens,
            context_lens_cpu=context_lens,
        )
        ids = put("input_ids", input_ids)
        if ahead_rows:
            ahead, sources = put("ahead_rows", ahead_rows), put("ahead_sources", ahead_sources)
            ids.index_copy_(0, ahead, previous[0].index_select(0, sources))
        return ids, put("positions", pos), meta, put("logits_indices", logits_indices)

    def _prepare_decode(
        self,
        rows: list[int],
        request_ids: list[str],
        input_ids: list[int],
        positions: np.ndarray,
        sampling: list[int] | None,
        previous: tuple[torch.Tensor, dict[str, int]] | None,
    ):
        """prepare() for a batch of one token per row (no prompt chunk, no drafts) at `positions`, the rows `sampling`
        sampling (None: all): tables, slots, context lengths and offsets are numpy over all of it."""
        n, bs = len(request_ids), self.config.block_size
        ahead_rows, ahead_sources = [], []  # placeholder rows, and where in `previous` their ids are
        num_ahead = input_ids.count(PLACEHOLDER)
        if num_ahead == n:  # every row runs ahead (async scheduling's steady state): no loop over the rows
            input_ids = np.zeros(n, dtype=np.int64)  # any valid ids until the device's own arrive
            if previous is not None:
                ahead_rows, ahead_sources = range(n), list(map(previous[1].get, request_ids))
                if None in ahead_sources:  # rows whose token the batch before did not sample (a failed batch)
                    ahead_rows = [i for i, source in enumerate(ahead_sources) if source is not None]
                    ahead_sources = [source for source in ahead_sources if source is not None]
        elif num_ahead:
            input_ids = list(input_ids)  # the batch's own stays as sent
            sources = previous[1] if previous is not None else {}
            for i, token in enumerate(input_ids):
                if token == PLACEHOLDER:
                    input_ids[i] = 0  # any valid id until the device's own arrives (a failed batch before sends none)
                    source = sources.get(request_ids[i])
                    if source is not None:
                        ahead_rows.append(i)
                        ahead_sources.append(source)

        inputs = self.inputs[self.num_steps % 2]
        self.num_steps += 1
        put = inputs.put
        tables, max_blocks = self.input_batch.gather(rows)
        slots = tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        context_lens = positions + 1
        meta = AttentionMetadata(
            query_start_loc=put("query_start_loc", np.arange(n + 1)),
            context_lens=put("context_lens", context_lens),
            block_tables=put("block_tables", tables.ravel(), (n, max_blocks)),
            slot_mapping=put("slot_mapping", slots),
            query_lens_cpu=[1] * n,
            context_lens_cpu=context_lens.tolist(),
        )
        ids = put("input_ids", input_ids)
        if ahead_rows:
            ahead, sources = put("ahead_rows", ahead_rows), put("ahead_sources", ahead_sources)
            ids.index_copy_(0, ahead, previous[0].index_select(0, sources))
        logits_indices = np.arange(n) if sampling is None else sampling
        return ids, put("positions", positions), meta, put("logits_indices", logits_indices)


def probe_rows(batch: Batch) -> dict[str, int]:
    """Each probed request's row in the flattened batch: its last known token's (the first of its logits rows)."""
    rows, end = {}, 0
    for r in batch.requests:
        end += len(r.token_ids)
        if r.probe and r.sample:
            rows[r.request_id] = end - r.num_logits_rows
    return rows
