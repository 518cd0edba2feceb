"""Where the inspected store is: its master (probed once) and the master's admin HTTP.

Every probe is bounded by the timeout given: never the Mooncake client's ~90 s retry.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpipe.connector.store.mooncake.admin import ADMIN_DEFAULT_PORT, AdminClient, AdminError, find_admin
from kvpipe.connector.store.mooncake.local_admin import local_master_admin
from kvpipe.connector.store.mooncake.master_address import MasterAddress

from .errors import InspectError, admin_errors

__all__ = ["admin_of_master", "check_master", "locate_admin"]


def check_master(address: MasterAddress, timeout_s: float) -> None:
    """Return when a master serves at ``address`` (HA: a leader), after one probe bounded by ``timeout_s``.

    :raises InspectError: (``master``) none serves; in HA, whether no coordinator listens or none leads.
    """
    if address.serving(timeout_s):
        return
    if address.is_ha and not address.coordinators_listening(timeout_s):
        raise InspectError(
            "master", f"no coordinator of {address.text} listens (no connection within {timeout_s:g} s)"
        )
    what = "no master leads" if address.is_ha else "mooncake master is not reachable"
    raise InspectError("master", f"{what} at {address.text} (no connection within {timeout_s:g} s)")


def admin_of_master(address: MasterAddress, timeout_s: float) -> tuple[str, int]:
    """Where the admin HTTP of the master at ``address`` is.

    The leader (etcd says which) running on this machine: its own ``--metrics_port``
    (:func:`~kvpipe.connector.store.mooncake.local_admin.local_master_admin`: ``kvpipe
    store``, ``kvpipe fleet`` and ``master: spawn`` pick free ports). Elsewhere: its host
    and :data:`ADMIN_DEFAULT_PORT`, the port a master started without the flag serves.

    :raises InspectError: (``metrics``) that host cannot be known (redis).
    """
    leader = address.leader(timeout_s)
    if leader is None:
        raise InspectError(
            "metrics",
            f"is needed: the leader behind {address.text} cannot be found to guess its admin HTTP",
        )
    return local_master_admin(*leader) or (leader[0], ADMIN_DEFAULT_PORT)


def locate_admin(
    metrics: Sequence[tuple[str, int]], master: MasterAddress | None, timeout_s: float
) -> AdminClient:
    """The admin HTTP to read: the first of ``metrics`` that leads, else ``master``'s on the default port.

    :raises InspectError: (``metrics``) neither is given, or none of them answers as a leader; when
        the admin HTTP was guessed from ``master``, the message says to pass ``--metrics``.
    """
    if metrics:
        with admin_errors():
            return find_admin(metrics, timeout_s)
    if master is None:
        raise InspectError(
            "metrics", "is required: the master's admin HTTP (its --metrics_port), or --master/--config"
        )
    try:
        return find_admin([admin_of_master(master, timeout_s)], timeout_s)
    except (AdminError, InspectError) as error:
        raise InspectError(
            "metrics",
            f"not given, and {error} (its own --metrics_port where it runs on this machine, else "
            "Mooncake's default): pass --metrics HOST:PORT",
        ) from None
