"""The chat templates shipped for models that carry none (issue 60): each renders its family's format (ChatML as
SmolLM2's own template does, Mistral's as mistral-common encodes), the one a model gets is its architecture's that
fits its vocabulary, --chat-template overrides the model's, and where none applies a chat request is a 400 that
says how to give one. A GGUF stripped of its template is served end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from engine.core.config import EngineConfig
from engine.model.model_files import GGUFReader, default_model_path
from engine.model.tokenizer import load_tokenizer
from engine.model.tokenizer.chat_template import (
    SHIPPED,
    compile_template,
    load_chat_template,
    shipped_template,
    template_for,
)
from gateway.app import build_app
from gateway.cli import main as cli_main
from gateway.config import GatewayConfig

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [SYSTEM, {"role": "user", "content": "Hello"}],
    [
        SYSTEM,
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "Who are you?"},
    ],
    [
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "And 2+2?"},
    ],
]
NO_TEMPLATE = (
    "the model has no chat template, and none shipped fits its architecture: pass --chat-template "
    "FILE_OR_NAME (names: chatml, gemma, llama3, mistral-v1, mistral-v3, phi3) to orcinus serve"
)


def render(name: str, messages: list[dict], add_generation_prompt: bool = True) -> str:
    return compile_template(shipped_template(name)).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token="<BOS>", eos_token="<EOS>"
    )


def copy_without_template(out: Path, architecture: str = "llama", tensors: bool = True) -> Path:
    """The bundled GGUF's tokenizer and metadata without tokenizer.chat_template, as `architecture`: with a tiny
    random Llama's tensors (the engine can serve it), or none (a tokenizer for the gateway alone)."""
    import gguf

    src = GGUFReader(default_model_path())
    w = gguf.GGUFWriter(str(out), architecture)
    tiny = {
        "llama.block_count": 1,
        "llama.embedding_length": 32,
        "llama.feed_forward_length": 64,
        "llama.attention.head_count": 2,
        "llama.attention.head_count_kv": 1,
        "llama.rope.dimension_count": 16,
        "llama.context_length": 256,
    }
    for key, f in src.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "tokenizer.chat_template"):
            continue
        if not key.startswith(("general.", "tokenizer.")) and architecture != "llama":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, tiny.get(key, f.contents()), f.types[0], sub)
    if tensors:
        rng = np.random.default_rng(0)
        vocab = len(src.fields["tokenizer.ggml.tokens"].contents())

        def weight(*shape):
            return (rng.standard_normal(shape) * 0.1).astype(np.float32)

        w.add_tensor("token_embd.weight", weight(vocab, 32))
        w.add_tensor("output_norm.weight", np.ones(32, np.float32))
        for name, shape in [
            ("attn_norm", (32,)),
            ("ffn_norm", (32,)),
            ("attn_q", (32, 32)),
            ("attn_k", (16, 32)),
            ("attn_v", (16, 32)),
            ("attn_output", (32, 32)),
            ("ffn_gate", (64, 32)),
            ("ffn_up", (64, 32)),
            ("ffn_down", (32, 64)),
        ]:
            w.add_tensor(
                f"blk.0.{name}.weight", np.ones(shape, np.float32) if name.endswith("norm") else weight(*shape)
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(default_model_path())


# ---------------------------------------------------------------- the templates


def test_chatml_renders_as_smollm2s_own_template(smollm2):
    """Byte for byte, for conversations with a system message (SmolLM2's own adds a default one where none is)."""
    own = compile_template(smollm2.chat_template)
    for messages in CONVERSATIONS[1:3]:
        for gen in (True, False):
            theirs = own.render(messages=messages, add_generation_prompt=gen, bos_token="", eos_token="")
            assert render("chatml", messages, gen) == theirs
    assert render("chatml", CONVERSATIONS[0]) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_llama3_gemma_and_phi3_render_their_families_turns():
    messages = CONVERSATIONS[2]
    assert render("llama3", messages) == (
        "<BOS><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWho are you?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render("gemma", messages) == (
        "<BOS><start_of_turn>user\nYou are terse.\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there<end_of_turn>\n"
        "<start_of_turn>user\nWho are you?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert render("phi3", messages) == (
        "<|system|>\nYou are terse.<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n"
        "<|user|>\nWho are you?<|end|>\n<|assistant|>\n"
    )
    assert render("phi3", CONVERSATIONS[0], add_generation_prompt=False) == "<|user|>\nHello<|end|>\n<EOS>"
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="alternate"):
        render("gemma", [{"role": "assistant", "content": "Hi"}])


def write_vocab_gguf(path: Path, model_file: Path) -> Path:
    """A vocabulary-only Llama GGUF of a SentencePiece tokenizer.model, as llama.cpp's converter writes one (no
    chat template)."""
    from test_sentencepiece_tokenizer import write_gguf

    from engine.model.tokenizer.sentencepiece_model import read_sentencepiece_model

    write_gguf(path, read_sentencepiece_model(model_file))
    return path


@pytest.mark.parametrize("version", ["v1", "v3", "v3 tekken"])
def test_a_mistral_model_without_a_template_gets_mistral_commons_tokens(version, tmp_path):
    """A Mistral GGUF (v1: [INST] as text; v3: as control tokens) or Tekken checkpoint without a template gets the
    shipped template of its vocabulary, whose prompts are the token ids mistral-common encodes."""
    mistral_common = pytest.importorskip("mistral_common")
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    data = Path(mistral_common.__file__).parent / "data"
    if version == "v3 tekken":
        (tmp_path / "tekken.json").symlink_to(data / "tekken_240718.json")
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
        ours, theirs = load_tokenizer(tmp_path), MistralTokenizer.v3(is_tekken=True)
    else:
        model = {"v1": "tokenizer.model.v1", "v3": "mistral_instruct_tokenizer_240323.model.v3"}[version]
        ours = load_tokenizer(write_vocab_gguf(tmp_path / "vocab.gguf", data / model))
        theirs = MistralTokenizer.v1() if version == "v1" else MistralTokenizer.v3()
    assert ours.chat_template == shipped_template("mistral-v1" if version == "v1" else "mistral-v3")
    kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    for messages in CONVERSATIONS:
        want = theirs.encode_chat_completion(
            ChatCompletionRequest(messages=[kinds[m["role"]](content=m["content"]) for m in messages])
        ).tokens
        assert ours.encode(ours.apply_chat_template(messages)) == want, messages


def test_the_template_a_model_gets_is_its_architectures_that_fits_its_vocabulary(smollm2):
    def name(architecture, is_token):
        source = template_for(architecture, is_token)
        return next((n for n in SHIPPED if shipped_template(n) == source), None)

    smol = lambda text: len(smollm2.encode(text)) == 1
    assert [name(a, smol) for a in ("llama", "mistral", "qwen2", "gemma2", "gemma3", "phi3", "gpt2", None)] == [
        "chatml",
        "chatml",
        "chatml",
        None,
        None,
        None,
        None,
        None,
    ]
    llama3 = {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"}
    assert name("llama", llama3.__contains__) == "llama3"
    assert name("llama", lambda text: False) == "mistral-v1"  # Llama 2's and Mistral v1's [INST] as text
    gemma = {"<start_of_turn>", "<end_of_turn>"}
    assert [name(a, gemma.__contains__) for a in ("gemma2", "gemma3", "gemma3_text", "qwen2")] == [
        "gemma",
        "gemma",
        "gemma",
        None,
    ]
    assert name("phi3", {"<|user|>", "<|assistant|>", "<|end|>"}.__contains__) == "phi3"


def test_chat_template_flag_takes_a_name_or_a_file(tmp_path):
    assert load_chat_template("gemma") == shipped_template("gemma")
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_chat_template(str(tmp_path / "t.jinja")).startswith("{% for m in messages %}")
    with pytest.raises(ValueError) as e:
        load_chat_template("chatml2")
    assert str(e.value) == (
        "--chat-template 'chatml2' is neither a file nor a shipped template (chatml, gemma, "
        "llama3, mistral-v1, mistral-v3, phi3)"
    )
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=r"bad.jinja: line 1: .*endfor"):
        load_chat_template(str(tmp_path / "bad.jinja"))


# ---------------------------------------------------------------- the gateway


@pytest.fixture(scope="module")
def gpt2_vocab(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer in a GGUF of an architecture no shipped template is for, its own template removed."""
    return copy_without_template(tmp_path_factory.mktemp("gpt2") / "gpt2-vocab.gguf", "gpt2", tensors=False)


def test_chat_without_any_template_is_a_400_that_says_how_to_give_one(gpt2_vocab):
    app = build_app(GatewayConfig(EngineConfig(model=str(gpt2_vocab))))  # no engine started: the 400 comes first
    assert app.state.orcinus.tokenizer.chat_template is None
    client = TestClient(app)
    for path, body in [("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})]:
        r = client.post(path, json={"messages": [{"role": "user", "content": "Hi"}], **body})
        assert (r.status_code, r.json()) == (
            400,
            {"error": {"message": NO_TEMPLATE, "type": "invalid_request_error", "param": "messages", "code": None}},
        ), path


def test_the_flag_overrides_the_models_template(gpt2_vocab, tmp_path):
    own = tmp_path / "own.jinja"
    own.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    for flag, want in [("phi3", shipped_template("phi3")), (str(own), own.read_text())]:
        for model in (gpt2_vocab, None):  # a model with none; the bundled one, with its own
            config = GatewayConfig(EngineConfig(model=None if model is None else str(model)), chat_template=flag)
            assert build_app(config).state.orcinus.tokenizer.chat_template == want


def test_a_bad_chat_template_flag_stops_the_server_before_the_engines_start(monkeypatch):
    monkeypatch.setattr("gateway.engines.replicas.Replicas.launch", lambda self: pytest.fail("engines started"))
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--chat-template", "/nonexistent/template.jinja"])
    assert str(e.value) == (
        "orcinus serve: --chat-template '/nonexistent/template.jinja' is neither a file nor a "
        "shipped template (chatml, gemma, llama3, mistral-v1, mistral-v3, phi3)"
    )


def test_a_gguf_stripped_of_its_template_chats_with_its_architectures(server_factory, tmp_path_factory, smollm2):
    """The bundled model's vocabulary (a Llama speaking ChatML) on a tiny random Llama, tokenizer.chat_template
    removed: chat is a 200, and its prompt is the token ids the embedded template gave (a system message first, as
    SmolLM2's own template adds a default one where none is)."""
    import httpx

    path = copy_without_template(tmp_path_factory.mktemp("stripped") / "stripped.gguf")
    messages = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
    want = smollm2.encode(smollm2.apply_chat_template(messages))
    with (
        server_factory("--model", str(path), "--kv-cache-memory", str(1 << 22)) as url,
        httpx.Client(base_url=url, timeout=120) as http,
    ):
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        assert http.post("/tokenize", json={"messages": messages}).json()["tokens"] == want
