"""A word-level tokenizer for a dummy-weight model folder, so text requests work with no download.

vLLM's benchmark client, its chat endpoint and the router's ``cache_aware`` policy
(which reads prompt text) all need a tokenizer; a folder made from a
``config.json`` alone has none. The vocabulary here is ``w0 .. w{n-1}``, one word
per token id of the model's ``vocab_size``, split on whitespace, so any token ids
decode to text that encodes back to the same ids: a dataset that draws random
ids (vLLM's ``random`` and ``prefix_repetition``) round-trips exactly.

Built with the ``tokenizers`` library (installed with vLLM) and saved as
``tokenizer.json`` with a ``tokenizer_config.json`` that names the fast tokenizer
class and a plain chat template (one line per message), which transformers'
``AutoTokenizer`` loads offline.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

#: the token ids a Llama config names by default: <unk>, <s>, </s>
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIAL = (UNK, BOS, EOS)

#: a chat is its messages, one per line as ``role: content``, then the assistant's turn
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def word(token_id: int) -> str:
    """The word of a token id (the special ones aside)."""
    return f"w{token_id}"


def random_text(rng: random.Random, tokens: int, vocab_size: int = 1024) -> str:
    """``tokens`` random words (no special token): a prompt of exactly that many tokens."""
    return " ".join(word(rng.randrange(len(SPECIAL), vocab_size)) for _ in range(tokens))


def write_tokenizer(folder: Path, vocab_size: int) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder`` (idempotent); the folder.

    Ids 0-2 are the special tokens a Llama config expects; every other id is a word.

    :raises ValueError: ``vocab_size`` leaves no room for a word.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size <= len(SPECIAL):
        raise ValueError(f"vocab_size: must be > {len(SPECIAL)} for a word-level tokenizer, got {vocab_size}")
    if (folder / "tokenizer.json").exists() and (folder / "tokenizer_config.json").exists():
        return folder
    vocab = {name: i for i, name in enumerate(SPECIAL)}
    vocab.update((word(i), i) for i in range(len(SPECIAL), vocab_size))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer.add_special_tokens(list(SPECIAL))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": False,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_atomically(folder / "tokenizer.json", tokenizer.to_str())
    _write_atomically(folder / "tokenizer_config.json", json.dumps(config, indent=1))
    return folder


def _write_atomically(path: Path, text: str) -> None:
    """A concurrent reader (another replica starting) sees the whole file or none."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    partial.replace(path)
