"""A writer killed midway through a layer-wise save leaves nothing a lookup can see, on a real master.

Its objects were reserved in a put session (invisible until the session ends) and
its seal was not written (a layer-wise save seals only once every layer is in):
the half-written objects never exist for a reader, and once the master drops the
reservation (``--put_start_discard_timeout_sec``) another writer stores the chunks.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpipe.connector.engines.launch import segment_holder
from kvpipe.connector.store.mooncake import MooncakeStore
from kvpipe.connector.store.mooncake.master import LocalMaster
from kvpipe.stages import seal_key

DISCARD_S = 1
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def master() -> Iterator[LocalMaster]:
    with LocalMaster(put_discard_s=DISCARD_S) as running:
        yield running


@pytest.fixture(scope="module")
def holder(master: LocalMaster) -> Iterator[MooncakeStore]:
    assert master.endpoints is not None
    with segment_holder(master.endpoints, "64MB") as store:
        yield store


def _killed_after_its_first_layer(master: LocalMaster) -> list[str]:
    """Run the writer until its first layer is written, SIGKILL it there; the keys it was writing."""
    assert master.endpoints is not None
    writer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.connector.store.killed_writer",
            master.endpoints.master_address,
            master.endpoints.metadata_server,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert writer.stdout is not None
        line = writer.stdout.readline()
        assert line, f"the writer ended before its first layer (exit {writer.wait(10)})"
        return list(json.loads(line))
    finally:
        os.killpg(writer.pid, signal.SIGKILL)
        writer.wait(10)


def test_a_writer_killed_midway_leaves_neither_an_object_nor_a_seal(master: LocalMaster, holder: MooncakeStore) -> None:
    keys = _killed_after_its_first_layer(master)

    assert holder.batch_is_exist(keys) == [0] * len(keys)
    assert holder.batch_is_exist([seal_key(key) for key in keys]) == [0] * len(keys)


def test_the_chunks_a_killed_writer_reserved_are_stored_by_the_next_writer_once_the_master_drops_them(
    master: LocalMaster, holder: MooncakeStore
) -> None:
    keys = _killed_after_its_first_layer(master)
    value = bytearray(64)
    address = ctypes.addressof((ctypes.c_char * len(value)).from_buffer(value))
    assert holder.register_buffer(address, len(value)) == 0
    try:
        deadline = time.monotonic() + 30 * DISCARD_S + 30  # the master sweeps its reservations on a timer
        sizes = [len(value)] * len(keys)
        while (codes := holder.batch_put_session_start(keys, sizes, holder.new_replicate_config())) != [0] * len(keys):
            assert time.monotonic() < deadline, f"the killed writer's reservations outlived the discard timeout: {codes}"
            holder.batch_put_session_revoke([key for key, code in zip(keys, codes, strict=True) if code == 0])
            time.sleep(0.2)
        assert holder.batch_put_session_end(keys) == [0] * len(keys)
    finally:
        holder.unregister_buffer(address)
    assert holder.batch_is_exist(keys) == [1] * len(keys)
