"""No orphans: ``kvscope up``, ``kvscope dashboard`` and ``kvscope serve`` (two tensor-parallel
ranks) are each SIGKILLed once their children are up; within :data:`GONE_WITHIN_SECONDS` none
of their descendants is alive and none of the ports the tree listened on is still listening.
``kvscope up`` and ``kvscope serve`` are also stopped with SIGTERM: they exit 0 and everything is
gone within :data:`STOP_WITHIN_SECONDS`, in order (``up``: the dashboard, then the agent, which checkpointed
its store; ``serve``: the server, then rank 1, then rank 0).

Processes are found by walking ``/proc`` (parent pids, socket inodes of ``/proc/<pid>/fd``,
``/proc/net/tcp{,6}``): Linux only, like the parent-death signal under test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.agent_process import agent_env
from tests.e2e.procs import start, wait_for
from tests.helpers import free_port

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="walks /proc; the parent-death signal is Linux's"),
]

KVSCOPE = [sys.executable, "-m", "kvscope"]
GONE_WITHIN_SECONDS = 15.0
"""How long after the parent's death its whole tree may take to go."""
STOP_WITHIN_SECONDS = 30.0
"""How long after SIGTERM: ``up`` first finishes the request in flight (seconds on a loaded
2-core machine), then stops each child with a 10 s grace."""
START_TIMEOUT_SECONDS = 180.0


def _state_and_ppid(pid: int) -> tuple[str, int] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = stat.rpartition(")")[2].split()[:2]  # after "pid (comm)", which may hold spaces
    return state, int(ppid)


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its new parent, is not)."""
    found = _state_and_ppid(pid)
    return found is not None and found[0] not in ("Z", "X")


def descendants(root: int) -> set[int]:
    """Every live process below ``root``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (found := _state_and_ppid(int(entry))) is not None:
            children.setdefault(found[1], []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return {pid for pid in out if alive(pid)}


def _listening() -> dict[int, int]:
    """Socket inode → port, for every listening TCP socket."""
    out: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    out[int(fields[9])] = int(fields[1].rpartition(":")[2], 16)
    return out


def listening_ports(pids: set[int]) -> set[int]:
    """The ports ``pids`` listen on."""
    inodes: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(int(target[8:-1]))
    return {port for inode, port in _listening().items() if inode in inodes}


@contextlib.contextmanager
def process_tree(cmd: list[str], log: Path) -> Iterator[tuple[subprocess.Popen[bytes], set[int]]]:
    """``cmd`` started (own session, output to ``log``) and the set of its descendants' pids the
    test records; every recorded pid and the parent are SIGKILLed at the end, whatever happened."""
    proc = start(cmd, log, env=agent_env())
    seen: set[int] = set()
    try:
        yield proc, seen
    finally:
        for pid in [proc.pid, *seen]:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def record(proc: subprocess.Popen[bytes], seen: set[int], at_least: int) -> set[int]:
    """Record ``proc``'s descendants (at least ``at_least`` of them) and the ports they listen on."""
    seen |= descendants(proc.pid)
    assert len(seen) >= at_least, f"expected at least {at_least} descendants, found {sorted(seen)}"
    return listening_ports(seen | {proc.pid})


def assert_gone(seen: set[int], ports: set[int], log: Path, within: float = GONE_WITHIN_SECONDS) -> dict[int, float]:
    """Wait (at most ``within`` seconds) until no pid of ``seen`` is alive and no port of ``ports`` listens; returns
    when each pid was first seen gone (seconds from the call)."""
    began = time.monotonic()
    gone_at: dict[int, float] = {}
    while True:
        left = sorted(pid for pid in seen if alive(pid))
        gone_at.update({pid: time.monotonic() - began for pid in seen - set(left) if pid not in gone_at})
        still = sorted(ports & set(_listening().values()))
        if not left and not still:
            return gone_at
        if time.monotonic() - began > within:
            comms = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for pid in left if alive(pid)}
            raise AssertionError(f"{within:g} s on: alive {comms}, listening {still}; log:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def answers(url: str) -> bool:
    return httpx.get(url, timeout=2).status_code == 200


def start_up(tmp_path: Path) -> tuple[list[str], int, int]:
    agent_port, dash_port = free_port(), free_port()
    cmd = [
        *KVSCOPE, "up", "--model", "kvscope_hybrid-tiny", "--max-requests", "50", "--data-dir", str(tmp_path / "data"),
        "--agent-port", str(agent_port), "--dashboard-port", str(dash_port),
    ]  # fmt: skip
    return cmd, agent_port, dash_port


def wait_up(proc: subprocess.Popen[bytes], agent_port: int, dash_port: int) -> None:
    wait_for("agent /readyz", proc, START_TIMEOUT_SECONDS, lambda: answers(f"http://127.0.0.1:{agent_port}/readyz"))
    wait_for("dashboard health", proc, START_TIMEOUT_SECONDS, lambda: answers(f"http://127.0.0.1:{dash_port}/_stcore/health"))


def test_a_killed_up_leaves_no_process_and_no_port(tmp_path: Path) -> None:
    cmd, agent_port, dash_port = start_up(tmp_path)
    log = tmp_path / "up.log"
    with process_tree(cmd, log) as (proc, seen):
        wait_up(proc, agent_port, dash_port)
        ports = record(proc, seen, at_least=2)  # agent (+ its decode workers), Streamlit
        assert {agent_port, dash_port} <= ports
        proc.kill()
        proc.wait(10)
        assert_gone(seen, ports, log)


def test_a_terminated_up_stops_everything_in_time(tmp_path: Path) -> None:
    cmd, agent_port, dash_port = start_up(tmp_path)
    log = tmp_path / "up.log"
    with process_tree(cmd, log) as (proc, seen):
        wait_up(proc, agent_port, dash_port)
        ports = record(proc, seen, at_least=2)
        (agent,) = [pid for pid in seen if b"kvscope\0agent" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        (streamlit,) = [pid for pid in seen if b"streamlit" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        proc.send_signal(signal.SIGTERM)
        gone_at = assert_gone(seen | {proc.pid}, ports, log, STOP_WITHIN_SECONDS)  # `up` itself: a zombie until waited for
        assert proc.wait(5) == 0, log.read_text()[-3000:]
    assert gone_at[streamlit] <= gone_at[agent] <= gone_at[proc.pid]  # the dashboard, then the agent, then up
    assert "checkpointed and closed" in (tmp_path / "data" / "agent.log").read_text()  # the agent stopped cleanly


def test_a_killed_dashboard_leaves_no_streamlit(tmp_path: Path) -> None:
    port = free_port()
    cmd = [*KVSCOPE, "dashboard", "--port", str(port), "--agent", f"http://127.0.0.1:{free_port()}"]
    log = tmp_path / "dashboard.log"
    with process_tree(cmd, log) as (proc, seen):
        wait_for("dashboard health", proc, START_TIMEOUT_SECONDS, lambda: answers(f"http://127.0.0.1:{port}/_stcore/health"))
        ports = record(proc, seen, at_least=1)
        assert port in ports
        proc.kill()
        proc.wait(10)
        assert_gone(seen, ports, log)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "terminated"])
def test_a_tensor_parallel_server_leaves_no_rank(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGKILL: the kernel ends rank 1. SIGTERM: uvicorn stops, then the engine closes its rank
    (gone before ``serve`` exits 0)."""
    port = free_port()
    cmd = [*KVSCOPE, "serve", "--model", "kvscope_hybrid-tiny", "--device", "cpu", "--tensor-parallel-size", "2", "--port", str(port)]
    log = tmp_path / "serve.log"
    with process_tree(cmd, log) as (proc, seen):
        health = wait_for("serve /health", proc, START_TIMEOUT_SECONDS, lambda: _health(port))
        ports = record(proc, seen, at_least=1)
        ranks = {r["rank"]: r["pid"] for r in health["ranks"]}
        assert ranks[0] == proc.pid and ranks[1] in seen
        assert port in ports
        proc.send_signal(sig)
        gone_at = assert_gone(seen | {proc.pid}, ports, log, GONE_WITHIN_SECONDS if sig == signal.SIGKILL else STOP_WITHIN_SECONDS)
        code = proc.wait(5)
    if sig == signal.SIGTERM:
        assert code == 0, log.read_text()[-3000:]
        assert gone_at[ranks[1]] <= gone_at[proc.pid]
        assert "server stopped, closing the engine" in log.read_text()


INTERMEDIATE = """
import multiprocessing, subprocess, sys, time
from engine.parent_death import preexec_die_with_parent
from tests.e2e.test_no_orphans import sleeping_child
popen = subprocess.Popen(["sleep", "60"], preexec_fn=preexec_die_with_parent())
spawned = multiprocessing.get_context("spawn").Process(target=sleeping_child)
spawned.start()
print(popen.pid, spawned.pid, flush=True)
time.sleep(60)
"""


def sleeping_child() -> None:
    """A ``multiprocessing`` child that arms the parent-death signal, then sleeps."""
    import multiprocessing

    from engine.parent_death import die_with_parent

    parent = multiprocessing.parent_process()
    assert parent is not None and parent.pid is not None
    assert die_with_parent(parent.pid)
    time.sleep(60)


def test_the_parent_death_signal_reaches_a_popen_and_a_spawned_child(tmp_path: Path) -> None:
    """What a tensor-parallel rank busy loading or computing relies on: no pipe end-of-file
    needed, the kernel kills the child (the e2e cases above see only idle children)."""
    proc = subprocess.Popen([sys.executable, "-c", INTERMEDIATE], stdout=subprocess.PIPE, env=agent_env())
    children: set[int] = set()
    try:
        assert proc.stdout is not None
        children = {int(pid) for pid in proc.stdout.readline().split()}
        assert len(children) == 2 and all(alive(pid) for pid in children)
        proc.kill()
        proc.wait(10)
        assert_gone(children, set(), tmp_path / "none.log")
    finally:
        for pid in [proc.pid, *children]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_child_whose_parent_died_before_it_armed_the_signal_ends_itself() -> None:
    script = "import time; from engine.parent_death import die_with_parent; die_with_parent(1); time.sleep(30)"
    done = subprocess.run([sys.executable, "-c", script], env=agent_env(), timeout=30)
    assert done.returncode == -signal.SIGKILL


def _health(port: int) -> dict | None:
    response = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    return response.json() if response.status_code == 200 else None
