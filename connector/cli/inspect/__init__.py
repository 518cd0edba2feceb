"""``kvpipe inspect``: what a live Mooncake store holds of one model's KV cache.

Why: a cache is worth what a lookup can hit, and a lookup hits a chunk only when
every object of it is stored: every storable group of every rank (the shards).
The bench's ``fragmentation`` workload measures how much of a store is chunks cut
in pieces; this is the same figure on a real deployment, for an operator asking
"is my cache whole, how big is it, where does it live, is the store shared?".

Where it comes from: the master's admin HTTP server only
(:mod:`kvpipe.connector.store.mooncake.admin`, ``--metrics_port``, 9003 by default),
never a Mooncake client (but to verify), so inspecting a store (without verifying)
does not change what it evicts next.

- :mod:`.locate`: the master (probed once) and its admin HTTP;
- :mod:`.replay`: a run's expected objects, its job replayed on a store of key names;
- :mod:`.report`: the report, built in named steps (:class:`ReportRequest` says what on);
- :mod:`.figures`: the report's figures, what each means, and their JSON;
- :mod:`.verify`: the scrubber (``--verify``, ``--repair``);
- :mod:`.render`: the report as text and as a PNG;
- :mod:`.errors`: :class:`InspectError`.

Errors: :class:`InspectError` (a ValueError) names the input (``master``,
``metrics``, ``model``, ``run``, ``verify``) and says what is wrong in one line, within the
HTTP timeout: no call here can wait the ~90 s a Mooncake ``setup()`` retries (the
verifying client is set up only once its master answered, within ``connect_timeout_s``).
"""

from .errors import InspectError
from .figures import InspectReport, NodeFigures, ShardId, Verification
from .locate import check_master, locate_admin
from .render import render_table, write_png
from .replay import ExpectedRun, replay_run
from .report import ReportRequest, build_report
from .verify import Scrub, scrub_client

__all__ = [
    "ExpectedRun",
    "InspectError",
    "InspectReport",
    "NodeFigures",
    "ReportRequest",
    "Scrub",
    "ShardId",
    "Verification",
    "build_report",
    "check_master",
    "locate_admin",
    "render_table",
    "replay_run",
    "scrub_client",
    "write_png",
]
