"""A deterministic chat-like workload: requests whose prompts share prefixes.

A few system prompts are shared by many conversations; each conversation goes on
for some turns, and turn k's prompt is turn k-1's whole context (its prompt and
generated output) plus a new user message. So prefixes repeat the way they do in
serving: across users (the system prompt) and across turns (the conversation).

Everything follows from the seed. Tokens are hashed per hash block the way vLLM
does it: each block's hash chains its parent's hash with the block's tokens, so a
hash names the whole prefix up to the end of its block.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

#: The parent of the first block's hash (vLLM seeds it from PYTHONHASHSEED).
ROOT_HASH = hashlib.sha256(b"kvpipe-synthetic-root").digest()


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt + self.output


def chain_hashes(tokens: Sequence[int], hash_block_size: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    """One hash per complete hash block: sha256(parent hash, block tokens)."""
    hashes = []
    for start in range(0, len(tokens) - hash_block_size + 1, hash_block_size):
        block = tokens[start : start + hash_block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{len(block)}I", *block)).digest()
        hashes.append(parent)
    return hashes


def generate(
    *,
    seed: int,
    requests: int,
    system_prompts: int,
    system_prompt_tokens: tuple[int, int],
    user_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    max_turns: int,
    vocab_size: int,
) -> list[Request]:
    """``requests`` requests in arrival order: a conversation's turns in order, conversations interleaved."""
    rng = random.Random(seed)

    def tokens(bounds: tuple[int, int]) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab_size) for _ in range(rng.randint(*bounds)))

    prompts = [tokens(system_prompt_tokens) for _ in range(system_prompts)]
    conversations: list[Iterator[Request]] = []
    started = 0
    produced: list[Request] = []
    while len(produced) < requests:
        if not conversations or rng.random() < 1 / max_turns:
            turns = rng.randint(1, max_turns)
            conversation = _conversation(
                started, rng.choice(prompts), turns, tokens, user_tokens, output_tokens
            )
            conversations.append(conversation)
            started += 1
        live = rng.randrange(len(conversations))
        turn = next(conversations[live], None)
        if turn is None:
            conversations.pop(live)
            continue
        produced.append(turn)
    return produced


def _conversation(
    index: int,
    system_prompt: tuple[int, ...],
    turns: int,
    tokens: Callable[[tuple[int, int]], tuple[int, ...]],
    user_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
) -> Iterator[Request]:
    context = system_prompt
    for turn in range(turns):
        prompt = context + tokens(user_tokens)
        output = tokens(output_tokens)
        yield Request(f"conv{index}-turn{turn}", prompt, output)
        context = prompt + output
