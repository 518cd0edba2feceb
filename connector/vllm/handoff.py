"""Prefill on one engine, decode on another: the request handed over through the store.

A disaggregating proxy (vllm-router ``--vllm-pd-disaggregation``, llm-d's
sidecar, vLLM's own proxies) sends a request twice. First to a prefill engine,
with ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}``;
then, once that answer is back, to a decode engine with the answer's
``kv_transfer_params`` and ``"do_remote_prefill": true``. The KV cache goes
between them through the store. A prefill's save runs behind its engine, so
the answer (and so the decode request) can arrive before the save has landed;
a decode engine that looked the prompt up then would miss and compute it all
again, without a word. The parameters close that race:

- **prefill** (a request with ``do_remote_decode``): its save is whole (every
  chunk of the prompt, also those it hit in its own prefix cache) and marked a
  handoff (:attr:`~kvpipe.stages.SaveRequest.handoff`: first in its step, never
  shed by the slow-store throttle); ``request_finished`` returns
  :meth:`Handoff.params`: the standard fields, and kvpipe's own under
  :data:`FIELD` (how many prompt tokens it stored, the block hash that ends
  them, the pool of keys they are in). A proxy copies them as they are.
- **decode** (a request whose parameters carry :data:`FIELD`): its lookup
  answers "ask again" (``None``) until the promised chunks are visible, for at
  most ``remote_prefill_wait_s`` from its arrival; then it loads them as any
  hit. Parameters of another pool (another model or cache prefix) or another
  hashing (the hash that ends the promise is not the request's own) are
  refused at once: waiting for keys this engine will never ask for would only
  delay a recompute.

Requests without these parameters are untouched: a prefix-sharing fleet and a
PD deployment run the same connector.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

#: kvpipe's entry in the transfer parameters: the standard fields stay as proxies expect them
FIELD = "kvpipe"
#: the shape of :data:`FIELD`'s value; a decode engine refuses another
VERSION = 1


class HandoffOutcome(StrEnum):
    """What became of one handoff, on either engine (the ``handoffs`` metric's label)."""

    OFFERED = "offered"  # prefill: transfer parameters returned
    FOUND = "found"  # decode: everything promised was visible at the first lookup
    WAITED = "waited"  # decode: visible after waiting
    EXPIRED = "expired"  # decode: the wait ran out; it loads what is there and computes the rest
    REFUSED = "refused"  # decode: parameters of another pool or hashing, or malformed: not waited for


class HandoffError(ValueError):
    """Transfer parameters whose :data:`FIELD` a decode engine cannot use (the message says why)."""


def remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether a request's transfer parameters ask its engine to prefill for another (``do_remote_decode``)."""
    return bool(params and params.get("do_remote_decode"))


@dataclass(frozen=True)
class Handoff:
    """What a prefill engine stored for a request: where a decode engine finds it.

    ``tokens``: the prompt tokens whose chunks it saved (whole hash blocks);
    ``last_hash``: the hex of the block hash that ends them (empty when
    ``tokens`` is 0); ``pool``: the keys' deployment
    (:func:`~kvpipe.stages.keys.shared_pool_id`).
    """

    tokens: int
    last_hash: str
    pool: str

    @classmethod
    def of(cls, block_hashes: Sequence[bytes], hash_block_size: int, tokens: int, pool: str) -> Handoff:
        """The handoff of ``tokens`` tokens of a request with ``block_hashes``."""
        blocks = tokens // hash_block_size
        return cls(blocks * hash_block_size, block_hashes[blocks - 1].hex() if blocks else "", pool)

    def params(self) -> dict[str, Any]:
        """The transfer parameters ``request_finished`` returns: the standard fields and kvpipe's.

        The standard ones say "prefill done, nothing to pull from this engine":
        the KV cache is in the store, under keys the decode engine makes itself.
        """
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
            FIELD: {
                "version": VERSION,
                "tokens": self.tokens,
                "last_hash": self.last_hash,
                "pool": self.pool,
            },
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> Handoff | None:
        """The handoff a decode request's parameters carry; None when they carry none.

        :raises HandoffError: :data:`FIELD` is there but not of this version's shape
            (the message names the field and the value).
        """
        if not params or FIELD not in params:
            return None
        value = params[FIELD]
        if not isinstance(value, Mapping) or value.get("version") != VERSION:
            raise HandoffError(f"kv_transfer_params.{FIELD}: expected version {VERSION}, got {value!r}")
        tokens, last_hash, pool = value.get("tokens"), value.get("last_hash"), value.get("pool")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise HandoffError(f"kv_transfer_params.{FIELD}.tokens: expected a count >= 0, got {tokens!r}")
        if not isinstance(last_hash, str) or not isinstance(pool, str):
            raise HandoffError(
                f"kv_transfer_params.{FIELD}: last_hash and pool must be strings, got {last_hash!r}, {pool!r}"
            )
        return cls(tokens, last_hash, pool)

    def mismatch(self, block_hashes: Sequence[bytes], hash_block_size: int, pool: str) -> str | None:
        """Why this handoff cannot be for a request with ``block_hashes`` on an engine of ``pool``; None: it can."""
        if self.pool != pool:
            return f"stored in pool {self.pool!r}, this engine reads {pool!r}"
        if self.tokens % hash_block_size:
            return f"{self.tokens} tokens are not whole hash blocks of {hash_block_size}"
        if self.tokens == 0:
            return None
        blocks = self.tokens // hash_block_size
        if blocks > len(block_hashes) or block_hashes[blocks - 1].hex() != self.last_hash:
            return (
                "the prefill engine hashed the prompt differently (another hash function or PYTHONHASHSEED)"
            )
        return None
