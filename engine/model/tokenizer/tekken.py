"""Mistral's Tekken (`tekken.json`): byte-level BPE on tiktoken, read the way mistral-common's Tekkenizer reads it."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from engine.model.tokenizer.byte_level import ByteLevelBPE

# The special tokens of files that list none (mistral-common's DEPRECATED_SPECIAL_TOKENS), ids 0..19; the rest
# up to default_num_special_tokens are fillers named <SPECIAL_{id}>.
DEFAULT_SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
)


def read_tekken(path: str | Path, **kwargs) -> ByteLevelBPE:
    """A `tekken.json`: ids 0..n-1 are the n special tokens (all special), then the first vocab_size - n ranks.

    Unlike mistral-common, special-token text in the input becomes its id, as chat templates need.
    """
    spec = json.loads(Path(path).read_text())
    config = spec["config"]
    num_special, vocab_size = config["default_num_special_tokens"], config["default_vocab_size"]
    listed = [t["token_str"] for t in sorted(spec.get("special_tokens") or [], key=lambda t: t["rank"])]
    names = listed or list(DEFAULT_SPECIAL_TOKENS)
    names += [f"<SPECIAL_{i}>" for i in range(len(names), num_special)]
    special = {name: i for i, name in enumerate(names)}
    # Ids keep the ranks' order, so tiktoken merging by id merges by rank.
    ranks = {
        base64.b64decode(t["token_bytes"]): num_special + t["rank"] for t in spec["vocab"][: vocab_size - num_special]
    }
    return ByteLevelBPE(
        ranks,
        special,
        bos_token_id=special["<s>"],
        eos_token_id=special["</s>"],
        name=Path(path).stem,
        pattern=config["pattern"],
        vocab_size=vocab_size,
        **kwargs,
    )
