"""Where stored objects' replicas lie, remembered between lookups (no master needed)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from kvpipe.connector.store.mooncake.replica_places import ReplicaPlaces


@dataclass
class _Replica:
    """A stand-in replica descriptor: its state, and its endpoint where it is in memory."""

    endpoint: str
    status: str = "complete"

    def is_memory_replica(self) -> bool:
        return bool(self.endpoint)

    def get_memory_descriptor(self) -> SimpleNamespace:
        return SimpleNamespace(buffer_descriptor=SimpleNamespace(transport_endpoint=self.endpoint))


def test_a_place_is_each_complete_replica_in_memory_a_read_may_go_to() -> None:
    places = ReplicaPlaces()
    replicas = {
        "two": [_Replica("h:1"), _Replica("h:2")],
        "one-incomplete": [_Replica("h:1"), _Replica("h:2", status="processing")],
        "on-disk": [_Replica("")],
    }
    places.learn([*replicas, "no-descriptor"], replicas, "complete")
    assert [places.endpoints(key) for key in [*replicas, "no-descriptor", "never-asked"]] == [
        ("h:1", "h:2"),
        ("h:1",),
        (),
        (),
        (),
    ]
    assert places.unknown([*replicas, "no-descriptor", "never-asked"]) == ["never-asked"]


def test_places_are_asked_for_again_once_older_than_their_max_age() -> None:
    now = [0.0]
    places = ReplicaPlaces(max_age_s=10.0, clock=lambda: now[0])
    places.learn(["k"], {"k": [_Replica("h:1")]}, "complete")
    now[0] = 9.9
    assert places.unknown(["k"]) == []
    now[0] = 10.0
    assert places.unknown(["k"]) == ["k"]


def test_only_the_most_recently_learned_keys_are_kept() -> None:
    places = ReplicaPlaces(max_keys=2)
    for key in ("a", "b"):
        places.learn([key], {key: [_Replica("h:1")]}, "complete")
    places.learn(["a"], {"a": [_Replica("h:2")]}, "complete")  # learned again: the newest
    places.learn(["c"], {"c": [_Replica("h:1")]}, "complete")
    assert len(places) == 2
    assert places.unknown(["a", "b", "c"]) == ["b"]
    assert places.endpoints("a") == ("h:2",)
