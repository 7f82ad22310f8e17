"""Instance-wide DuckDB settings every connection of the agent gets: the time zone, the memory
limit and the thread count.

* **UTC.** DuckDB's session time zone (``TimeZone``, provided by the ICU extension, which the
  ``duckdb`` wheel links statically) starts as the host's (``TZ``, ``/etc/localtime``). It decides
  what ``now()::TIMESTAMP``, ``current_timestamp`` compared with a naive ``TIMESTAMP`` column,
  ``date_trunc`` on a ``TIMESTAMPTZ`` and ``strftime`` give, so the same SQL over the same rows
  would answer differently in Kolkata and in Los Angeles. Every column the store holds is a naive
  UTC timestamp (:func:`agent.store.utc_now`), so every connection is set to ``UTC``.
  ``duckdb.connect(config={"TimeZone": ...})`` is refused (ICU is not loaded at that point), so
  :func:`apply_instance_settings` uses ``SET GLOBAL`` before the configuration is locked; every
  later ``cursor()`` of the instance inherits it.
* **Memory.** DuckDB's own default ``memory_limit`` is 80 % of RAM. The agent sets
  :func:`default_memory_limit_bytes` (half of RAM, or of the cgroup limit when that is lower)
  unless configured. The limit bounds DuckDB's buffer manager (hash tables, sorts, aggregates:
  they spill or fail with an Out of Memory error); it does not bound what one scalar function
  allocates for one value (``repeat('x', 10^9)``, ``list_sort`` of a huge list), which the
  concurrency cap of :mod:`agent.query_gate` bounds in number instead.
* **Threads.** DuckDB's worker pool is shared by every connection of the instance, ingest
  included. :func:`default_threads` leaves one core to the rest of the agent (the HTTP loop, the
  ingest flush, decoding); queries also run at a lower CPU priority (:mod:`agent.sql`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import duckdb

TIME_ZONE = "UTC"
DEFAULT_MEMORY_FRACTION = 0.5
CGROUP_MEMORY_FILES = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where that is not
    available), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """DuckDB threads when none are configured: one fewer than :func:`usable_cpus`, at least 1,
    so one core stays with ingest and the HTTP loop."""
    return max(1, usable_cpus() - 1)


def physical_memory_bytes() -> int | None:
    """RAM this process may use: the machine's physical memory (``sysconf``), lowered to the
    cgroup memory limit when one is set; ``None`` when neither can be read."""
    found: list[int] = []
    with contextlib.suppress(AttributeError, ValueError, OSError):
        found.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for path in CGROUP_MEMORY_FILES:
        try:
            text = path.read_text(encoding="ascii").strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < 2**62:  # v1 writes a huge number for "no limit"
            found.append(int(text))
    return min(found) if found else None


def default_memory_limit_bytes() -> int | None:
    """Half of :func:`physical_memory_bytes`; ``None`` (DuckDB's own default) when unknown."""
    total = physical_memory_bytes()
    return None if total is None else int(total * DEFAULT_MEMORY_FRACTION)


def apply_instance_settings(
    con: duckdb.DuckDBPyConnection,
    *,
    memory_limit_bytes: int | None = None,
    threads: int | None = None,
) -> None:
    """Set ``TimeZone = 'UTC'``, ``memory_limit`` and ``threads`` for the whole instance of
    ``con`` (``SET GLOBAL``; call it before ``lock_configuration``). ``None`` takes
    :func:`default_memory_limit_bytes` / :func:`default_threads`.

    Raises:
        ValueError: ``memory_limit_bytes`` or ``threads`` below 1.
        duckdb.Error: DuckDB refused a setting (for example the configuration is already locked).
    """
    memory = default_memory_limit_bytes() if memory_limit_bytes is None else memory_limit_bytes
    count = default_threads() if threads is None else threads
    if memory is not None and memory < 1:
        raise ValueError(f"memory_limit_bytes must be >= 1, got {memory}")
    if count < 1:
        raise ValueError(f"threads must be >= 1, got {count}")
    con.execute(f"SET GLOBAL TimeZone = '{TIME_ZONE}'")
    if memory is not None:
        con.execute(f"SET GLOBAL memory_limit = '{int(memory)}B'")
    con.execute(f"SET GLOBAL threads = {int(count)}")


def use_utc(con: duckdb.DuckDBPyConnection) -> None:
    """Only the time zone: ``SET GLOBAL TimeZone = 'UTC'`` (for connections the agent does not
    own, such as ``kvscope sql --db FILE``)."""
    con.execute(f"SET GLOBAL TimeZone = '{TIME_ZONE}'")
