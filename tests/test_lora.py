"""LoRA adapters (float32): PEFT adapters on tiny random checkpoints give transformers + peft's tokens and logprobs, a
step mixing adapters and the base model gives each request its tokens alone, the pool keeps at most max_loras
resident (LRU, never one a request holds), and the prefix cache never shares blocks across adapters."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.lora_pool import AdapterError, AdapterGate, AdapterNotFoundError, LoraPool
from engine.core.request import Request, RequestOptions
from tests.test_families import build

peft = pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 200, 33, 8, 99, 120], list(range(40, 90)), [7] * 3]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, rslora): ranks 8 and 64, different targets, one rslora.
ADAPTERS = {
    "a": (8, 16, ["q_proj", "v_proj", "down_proj"], False),
    "b": (64, 16, ALL, True),
    "c": (8, 32, ["k_proj", "o_proj", "gate_proj", "up_proj"], False),
}


def make_adapter(base_dir, out_dir, kind: str, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int):
    """A random, non-zero PEFT adapter (B is not zero-initialised) saved to out_dir; returns the peft model."""
    import transformers

    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[kind]
    torch.manual_seed(seed)
    base = cls.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
    )
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def served(request, tmp_path_factory):
    """(kind, LLM serving every ADAPTERS entry with two slots, {name: its transformers + peft model}, base hf)."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    hf = build(kind, root / "base", **({"tie_word_embeddings": False} if kind == "qwen2" else {}))
    refs = {
        name: make_adapter(root / "base", root / name, kind, *spec, seed=i + 1)
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }
    specs = tuple(f"{name}={root / name}" for name in ADAPTERS)
    llm = LLM(str(root / "base"), dtype="float32", max_num_seqs=16, lora=specs, max_loras=2, max_lora_rank=64)
    return kind, llm, refs, hf


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def test_each_adapter_gives_transformers_peft_tokens_and_logprobs(served):
    kind, llm, refs, hf = served
    base = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    for name, ref in refs.items():
        got = [c.token_ids for c in llm.generate(PROMPTS, GREEDY, lora=[name] * len(PROMPTS))]
        assert got == [hf_greedy(ref, p, 12) for p in PROMPTS], (kind, name)
        assert got != base, (kind, name)  # the adapter changes the answers: it was applied
        one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
        [out] = llm.generate([PROMPTS[1]], one, lora=[name])
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([PROMPTS[1]])).logits[0, -1], -1)
        for token, lp in out.logprobs[0].top:
            assert abs(lp - want[token].item()) < 1e-4 * max(1.0, abs(lp)), (kind, name, token)
    assert base == [hf_greedy(hf, p, 12) for p in PROMPTS]


def test_a_mixed_batch_gives_each_request_its_tokens_alone(served):
    """Four adapters' worth of requests (three adapters and the base) over two slots: adapters swap in and out while
    others run, and every request's tokens are its own run's."""
    _, llm, _, _ = served
    names = ["", "a", "b", "c"]
    alone = {(n, i): llm.generate([p], GREEDY, lora=[n])[0].token_ids for n in names for i, p in enumerate(PROMPTS)}
    jobs = [(n, i) for i in range(len(PROMPTS)) for n in names] * 2
    got = llm.generate([PROMPTS[i] for _, i in jobs], GREEDY, lora=[n for n, _ in jobs])
    assert [c.token_ids for c in got] == [alone[j] for j in jobs]
    gate = llm.engine.adapters
    assert not gate.held and not gate.holding and len(gate.pool.slot_of) <= 2


def test_check_in_runs_keep_each_rows_adapter(served):
    """Runs of several steps (--check-in-steps) over a batch mixing adapters and the base: each row keeps its slot in
    every step of the run, so its tokens are the single-step ones."""
    _, llm, _, _ = served
    names = ["", "a", "b"]
    jobs = [(n, i) for i in range(len(PROMPTS)) for n in names]
    prompts, loras = [PROMPTS[i] for _, i in jobs], [n for n, _ in jobs]
    want = [c.token_ids for c in llm.generate(prompts, GREEDY, lora=loras)]
    cfg = llm.engine.config
    runs = LLM(
        cfg.model,
        dtype="float32",
        max_num_seqs=16,
        lora=cfg.lora,
        max_loras=3,
        max_lora_rank=64,
        check_in_steps=4,
        speculative="off",
    )
    assert [c.token_ids for c in runs.generate(prompts, GREEDY, lora=loras)] == want
    assert runs.engine.num_iterations < GREEDY.max_tokens  # the decode steps ran in runs of several


def test_the_prefix_cache_never_shares_blocks_across_adapters(served):
    _, llm, _, _ = served
    engine = llm.engine
    prompt = list(range(100, 164))  # four full blocks
    cached = {}
    for name in ["a", "b", "", "a"]:
        req = engine.add_request(prompt, GREEDY, RequestOptions(lora=name))
        while engine.has_unfinished():
            engine.step()
        cached.setdefault(name, []).append(req.num_cached_tokens)
    # The first run under each of a, b and the base finds nothing (same tokens, other K/V); a again finds a's.
    assert cached == {"a": [0, 48], "b": [0], "": [0]}


def test_an_unknown_or_unloaded_adapter_is_refused_and_a_loaded_one_serves(served, tmp_path):
    from engine.core.sampling_params import InvalidRequestError

    _, llm, refs, _ = served
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="The model `nope` does not exist."):
        engine.add_request([1, 2, 3], GREEDY, RequestOptions(lora="nope"))
    with pytest.raises(AdapterError, match="has already been loaded"):
        engine.load_lora("a", "/nowhere")
    with pytest.raises(AdapterError, match="no LoRA adapter at /nowhere"):
        engine.load_lora("d", "/nowhere")
    refs["a"].save_pretrained(tmp_path / "a2")
    engine.load_lora("a2", str(tmp_path / "a2"))
    want = llm.generate([PROMPTS[0]], GREEDY, lora=["a"])[0].token_ids
    assert llm.generate([PROMPTS[0]], GREEDY, lora=["a2"])[0].token_ids == want
    engine.unload_lora("a2")
    with pytest.raises(InvalidRequestError):
        engine.add_request([1, 2, 3], GREEDY, RequestOptions(lora="a2"))
    with pytest.raises(AdapterNotFoundError, match="The lora adapter 'a2' cannot be found."):
        engine.unload_lora("a2")


def test_an_adapter_of_too_high_a_rank_or_another_model_is_refused(tmp_path):
    root = tmp_path
    build("llama", root / "base")
    make_adapter(root / "base", root / "r64", "llama", 64, 16, ["q_proj"], False, seed=1)
    with pytest.raises(AdapterError, match="has rank 64; this server takes ranks up to 16"):
        LLM(str(root / "base"), dtype="float32", lora=(f"x={root / 'r64'}",))
    build("llama", root / "wide", hidden_size=96)
    make_adapter(root / "wide", root / "wider", "llama", 8, 16, ["q_proj"], False, seed=1)
    with pytest.raises(AdapterError, match=r"q_proj of layer 0 is \(96, 96\) \(out, in\); the model's is \(64, 64\)"):
        LLM(str(root / "base"), dtype="float32", lora=(f"x={root / 'wider'}",))


def test_the_cpu_op_gives_pytorchs_delta_and_each_row_its_value_alone():
    """The C++ op of a float32 step: the PyTorch path's deltas (to rounding), base rows untouched (a NaN there stays
    its own), and a row's value the same bit for bit alone or in a mix of slots."""
    from types import SimpleNamespace

    from engine.model.lora import LoraSlots

    class RowWise(torch.nn.Module):  # a base whose rows come out the same whatever the batch (a GEMM's need not)
        def __init__(self, out: int):
            super().__init__()
            self.w = torch.nn.Parameter(torch.linspace(-1, 1, out))

        def forward(self, x):
            return x.sum(1, keepdim=True) * self.w

    hidden, inter, q, kv = 40, 72, 40, 24
    layer = SimpleNamespace(
        shape=SimpleNamespace(hidden_size=hidden, intermediate_size=inter),
        q_size=q,
        kv_size=kv,
        qkv_proj=RowWise(q + 2 * kv),
        o_proj=RowWise(hidden),
        gate_up_proj=RowWise(2 * inter),
        down_proj=RowWise(hidden),
    )
    slots = LoraSlots(SimpleNamespace(layers=[layer]), max_loras=3, max_rank=8)
    g = torch.Generator().manual_seed(0)
    for proj in slots.layers[0].values():
        for buf in proj.buffers():
            buf.copy_(torch.randn(buf.shape, generator=g))
    slots.slot_scales[:] = [0.5, 2.0, 1.25]
    x = torch.randn(12, inter, generator=g)
    x[3:5] = float("nan")  # the base rows of the mix below
    for name, proj in slots.layers[0].items():
        xi = x[:, : proj.in_features].contiguous()
        slots.set_rows([2, -1, 0, 2, 1], [3, 2, 1, 4, 2])
        assert slots.rows.mine is not None  # the C++ op runs
        mixed = proj(xi)
        mine, slots.rows.mine = slots.rows.mine, None
        torch.testing.assert_close(mixed, proj(xi), equal_nan=True, rtol=1e-5, atol=1e-4, msg=name)
        slots.rows.mine = mine
        assert torch.equal(mixed[3:5].isnan(), proj.base(xi)[3:5].isnan()), name
        for row, slot in [(0, 2), (5, 0), (7, 2), (11, 1)]:
            slots.set_rows([slot], [1])
            assert torch.equal(proj(xi[row : row + 1]), mixed[row : row + 1]), (name, row)


def test_the_pool_evicts_the_least_recently_used_unheld_adapter_only():
    pool = LoraPool(2)
    a, b, c = (pool.register(n) for n in "abc")
    assert pool.acquire(a) == (0, True) and pool.acquire(b) == (1, True)
    assert pool.acquire(c) is None  # both held
    pool.release(a)
    assert pool.acquire(a) == (0, False)  # still resident: no load
    pool.release(b)
    pool.release(a)  # now a was used last: b goes first
    assert pool.acquire(c) == (1, True) and pool.slot_of == {a: 0, c: 1}
    pool.unregister("c")  # held: its slot frees when its request is done
    assert pool.slot_of == {a: 0, c: 1}
    pool.release(c)
    assert pool.slot_of == {a: 0} and pool.free_slots == [1]
    assert pool.register("c") != c  # a name loaded again is another adapter (the prefix cache keys by id)
    with pytest.raises(AdapterError, match="already been loaded"):
        pool.register("a")


def test_a_waiting_adapter_gets_a_slot_though_others_keep_coming():
    """One slot held by adapter a: b's request waits, and a's newcomers wait behind it rather than keep a's slot held
    forever; each enters in turn."""
    loads, entered = [], []
    gate = AdapterGate(1, lambda slot, name: loads.append((slot, name)))
    gate.pool.register("a"), gate.pool.register("b")

    def add(request_id: str, name: str) -> None:
        gate.add(Request(request_id, [1], GREEDY, options=RequestOptions(lora=name)), lambda r: entered.append(r))

    add("a1", "a")
    add("b1", "b")
    add("a2", "a")
    assert [r.request_id for r in entered] == ["a1"] and list(gate.held) == ["b1", "a2"]
    gate.done(["a1"])
    gate.admit_held(entered.append)
    assert [r.request_id for r in entered] == ["a1", "b1"] and gate.slots(["b1", "x"]) == [0, -1]
    add("b2", "b")  # b is resident and a's request waits for it: b2 waits too
    gate.admit_held(entered.append)
    assert list(gate.held) == ["a2", "b2"]
    gate.done(["b1"])
    gate.admit_held(entered.append)
    gate.done(["a2"])
    gate.admit_held(entered.append)
    assert [r.request_id for r in entered] == ["a1", "b1", "a2", "b2"]
    assert loads == [(0, "a"), (0, "b"), (0, "a"), (0, "b")] and not gate.held


def test_an_adapter_unloaded_while_it_runs_finishes_and_gives_its_memory_back(tmp_path):
    """Unloading an adapter mid-run: its running request finishes with its own tokens, the requests waiting for its
    slot are handed back (the server fails them with a 404), and once the last is done the slot is free and the
    adapter's host tensors are gone."""
    import gc
    import weakref

    build("llama", tmp_path / "base")
    for i, name in enumerate("ab"):
        make_adapter(tmp_path / "base", tmp_path / name, "llama", 8, 16, ALL, False, seed=i + 1)
    llm = LLM(str(tmp_path / "base"), dtype="float32", lora=(f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"), max_loras=1)
    engine = llm.engine
    want = llm.generate([PROMPTS[0]], GREEDY, lora=["a"])[0].token_ids
    host = weakref.ref(engine.executor.adapters["a"].weights[0, "q_proj"][0])
    running = engine.add_request(PROMPTS[0], GREEDY, RequestOptions(lora="a"))
    waiting = engine.add_request(PROMPTS[1], GREEDY, RequestOptions(lora="b"))  # the only slot is a's
    for _ in range(3):
        engine.step()
    assert engine.unload_lora("b") == [waiting]
    assert engine.unload_lora("a") == []
    pool = engine.adapters.pool
    assert pool.free_slots == [] and list(pool.slot_of.values()) == [0]  # a's slot stays a's while its request runs
    while engine.has_unfinished():
        engine.step()
    assert running.output_token_ids == want
    assert pool.slot_of == {} and pool.free_slots == [0] and not pool.users and pool.ids == {}
    assert not engine.adapters.held and not engine.adapters.holding
    gc.collect()
    assert engine.executor.adapters == {} and host() is None


def test_an_adapter_holding_a_nan_or_an_infinity_is_refused(tmp_path):
    """Such a value in a slot's B reaches the base model's rows on the PyTorch path (a pad's 0 x NaN): refused."""
    from safetensors.torch import load_file, save_file

    from engine.model.lora import read_adapter

    build("llama", tmp_path / "base")
    make_adapter(tmp_path / "base", tmp_path / "ok", "llama", 8, 16, ["q_proj", "v_proj"], False, seed=1)
    assert read_adapter(str(tmp_path / "ok"), 2, 16).rank == 8
    weights = tmp_path / "ok" / "adapter_model.safetensors"
    tensors = load_file(weights)
    for bad in (float("nan"), float("inf")):
        tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"][3, 2] = bad
        save_file(tensors, weights)
        with pytest.raises(AdapterError, match="holds non-finite values .NaN or infinity. in layer 1 v_proj"):
            read_adapter(str(tmp_path / "ok"), 2, 16)
