"""The pool relay: the shared pool's events from every replica's stream, on every worker's stream, and nothing else."""

from __future__ import annotations

import time

import msgspec
import zmq
from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored, KVEventBatch, ZmqEventPublisher

from kvpipe.connector.fleet.pool_relay import TOPIC, PoolRelay
from kvpipe.connector.store.mooncake.master import LOOPBACK, free_ports

POOL = "vllm-mooncake-store:tiny-llama"


def stored(block_hash: int, ownership: str | None) -> BlockStored:
    return BlockStored(
        block_hashes=[block_hash],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=4,
        lora_id=None,
        medium=MEDIUM_CPU if ownership else "GPU",
        lora_name=None,
        ownership=ownership,
    )


def test_every_worker_stream_carries_each_replicas_pool_events_and_no_engine_block() -> None:
    replica_a, replica_b, out_a, out_b = free_ports(4)
    replicas = [
        ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", topic=TOPIC) for port in (replica_a, replica_b)
    ]
    context = zmq.Context()
    subscribers = []
    for port in (out_a, out_b):
        subscriber = context.socket(zmq.SUB)
        subscriber.connect(f"tcp://{LOOPBACK}:{port}")
        subscriber.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        subscribers.append(subscriber)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    heard: list[set[int]] = [set(), set()]
    engine_blocks_heard = 0
    try:
        with PoolRelay(
            [f"tcp://{LOOPBACK}:{port}" for port in (replica_a, replica_b)],
            [f"tcp://*:{port}" for port in (out_a, out_b)],
        ):
            deadline = time.monotonic() + 20
            # a SUB misses what went out before it joined: publish until both workers heard both pools
            while any(len(h) < 2 for h in heard) and time.monotonic() < deadline:
                for index, publisher in enumerate(replicas):
                    batch = [stored(10 + index, POOL), stored(20 + index, None)]
                    publisher.publish(KVEventBatch(ts=time.time(), events=batch))
                time.sleep(0.05)
                for worker, subscriber in enumerate(subscribers):
                    while subscriber.poll(10):
                        _, _, payload = subscriber.recv_multipart()
                        for event in decoder.decode(payload).events:
                            if event.ownership == POOL:
                                heard[worker].update(event.block_hashes)
                            else:
                                engine_blocks_heard += 1
    finally:
        for subscriber in subscribers:
            subscriber.close(linger=0)
        context.term()
        for publisher in replicas:
            publisher.shutdown()
    assert heard == [{10, 11}, {10, 11}]
    assert engine_blocks_heard == 0
