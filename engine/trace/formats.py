"""Readers for real request traces with prefix-block hash ids.

* **weka** (callanjfox/kv-cache-tester, "weka v1", the InferenceX AgentX format): one JSON object
  per session file — ``id``, ``block_size`` (64), ``hash_id_scope: "local"``, ``requests[]`` with
  ``t`` (seconds from session start), ``in``, ``out``, ``hash_ids`` (full blocks only); sub-agents
  are entries ``{"type": "subagent", "agent_id", "t", "requests": [...]}`` whose requests' ``t``
  count from the sub-agent's start and share the session's id space.
* **mooncake** (kvcache-ai/Mooncake FAST'25): JSONL, one request a line — ``timestamp`` (ms),
  ``input_length``, ``output_length``, ``hash_ids`` (512-token blocks, the last one partial when
  ``input_length`` is not a multiple of 512); ids are global.

Both become :class:`TraceRequest` rows. Hash ids are namespaced (a weka session's id; a single
namespace for Mooncake) so that local ids of different sessions never collide.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEKA_BLOCK_TOKENS = 64
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace file or line that cannot be read; the message names the file, line and field."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRequest:
    """One request of a trace, in trace time.

    Attributes:
        arrival_seconds: when the request arrives, seconds from the trace start.
        session_id: the conversation it belongs to (``trace_0002``, ``trace_0277/agent_001``);
            requests of one session replay in order.
        request_id: unique within the trace.
        namespace: scope of ``hash_ids``.
        hash_ids: ids of the prompt's leading full blocks (``block_tokens`` tokens each); two
            requests share k leading blocks exactly when their first k ids are equal.
        input_tokens: prompt length in the trace's tokens (≥ len(hash_ids)·block_tokens).
        output_tokens: output length in the trace's tokens.
        block_tokens: the trace's block size.
    """

    arrival_seconds: float
    session_id: str
    request_id: str
    namespace: str
    hash_ids: tuple[int, ...]
    input_tokens: int
    output_tokens: int
    block_tokens: int

    @property
    def remainder_tokens(self) -> int:
        """Prompt tokens beyond the last full block (request-unique in the replay)."""
        return max(0, self.input_tokens - len(self.hash_ids) * self.block_tokens)


def _field(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise TraceError(f"{where}: missing field {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise TraceError(f"{where}: field {key!r} must be {names}, got {value!r:.80}")
    if isinstance(value, float) and not math.isfinite(value):
        raise TraceError(f"{where}: field {key!r} must be a finite number, got {value}")
    if isinstance(value, (int, float)) and value < 0:
        raise TraceError(f"{where}: field {key!r} must be >= 0, got {value}")
    return value


def _hash_ids(obj: Any, where: str) -> tuple[int, ...]:
    ids = _field(obj, "hash_ids", list, where)
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int):
            raise TraceError(f"{where}: hash_ids[{i}] must be an integer, got {h!r:.40}")
    return tuple(ids)


def read_weka_session(path: Path, offset_seconds: float = 0.0) -> list[TraceRequest]:
    """Requests of one weka session file (sub-agents included), arrival shifted by ``offset_seconds``.

    Raises:
        TraceError: unreadable JSON, a missing or ill-typed field, naming file and request.
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:{exc.lineno}: malformed JSON: {exc.msg}") from None
    session = str(_field(doc, "id", str, str(path)))
    block = int(_field(doc, "block_size", int, str(path)))
    if block <= 0:
        raise TraceError(f"{path}: block_size must be positive")
    requests = _field(doc, "requests", list, str(path))
    out: list[TraceRequest] = []

    def add(entries: list[Any], sub_session: str, base_t: float, where: str) -> None:
        for i, r in enumerate(entries):
            at = f"{where}.requests[{i}]"
            if isinstance(r, dict) and r.get("type") == "subagent":
                agent = str(_field(r, "agent_id", str, at))
                add(_field(r, "requests", list, at), f"{session}/{agent}", base_t + float(_field(r, "t", (int, float), at)), at)
                continue
            out.append(
                TraceRequest(
                    arrival_seconds=offset_seconds + base_t + float(_field(r, "t", (int, float), at)),
                    session_id=sub_session,
                    request_id=f"{sub_session}#{i}",
                    namespace=session,
                    hash_ids=_hash_ids(r, at),
                    input_tokens=int(_field(r, "in", int, at)),
                    output_tokens=int(_field(r, "out", int, at)),
                    block_tokens=block,
                )
            )

    add(requests, session, 0.0, str(path))
    return out


def read_mooncake(path: Path) -> list[TraceRequest]:
    """Requests of a Mooncake JSONL trace; the partial last block becomes remainder.

    Raises:
        TraceError: a malformed line, naming file and line number. Blank lines are skipped.
    """
    out: list[TraceRequest] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        at = f"{path}:{n}"
        try:
            r = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{at}: malformed JSON: {exc.msg}") from None
        input_len = int(_field(r, "input_length", int, at))
        ids = _hash_ids(r, at)
        full = min(len(ids), input_len // MOONCAKE_BLOCK_TOKENS)
        out.append(
            TraceRequest(
                arrival_seconds=float(_field(r, "timestamp", (int, float), at)) / 1000.0,
                session_id="mooncake",
                request_id=f"mooncake#{n}",
                namespace="mooncake",
                hash_ids=ids[:full],
                input_tokens=input_len,
                output_tokens=int(_field(r, "output_length", int, at)),
                block_tokens=MOONCAKE_BLOCK_TOKENS,
            )
        )
    return out


def detect_format(path: Path) -> str:
    """``"weka"`` for a directory or a ``.json`` session file, ``"mooncake"`` for ``.jsonl``."""
    if path.is_dir() or path.suffix == ".json":
        return "weka"
    if path.suffix == ".jsonl":
        return "mooncake"
    raise TraceError(f"{path}: unknown trace format (expected a weka directory / .json file or a mooncake .jsonl)")


def weka_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise TraceError(f"{path}: no weka session files (*.json)")
    return files


def load_trace(path: Path, *, session_stagger_seconds: float = 30.0) -> list[TraceRequest]:
    """Every request of a trace, sorted by arrival (ties keep file order).

    Weka sessions carry no absolute start time; session k (in file-name order) starts
    ``k · session_stagger_seconds`` after the first, so sessions overlap as users would.

    Raises:
        TraceError: the path does not exist, the format is unknown, or a file is malformed.
    """
    if not path.exists():
        raise TraceError(f"{path}: no such trace file or directory")
    if detect_format(path) == "mooncake":
        requests = read_mooncake(path)
    else:
        requests = []
        for k, f in enumerate(weka_files(path)):
            requests.extend(read_weka_session(f, k * session_stagger_seconds))
    requests.sort(key=lambda r: r.arrival_seconds)
    return requests



@dataclass(frozen=True, slots=True, kw_only=True)
class ChatTurn:
    """One model call of an agent conversation: the messages it was sent (``{"role",
    "content"}``, text) and the length of the answer it gave (characters)."""

    messages: tuple[dict[str, str], ...]
    answer_chars: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatSession:
    session_id: str
    turns: tuple[ChatTurn, ...]


SWE_AGENT_ROLES = frozenset({"system", "user", "assistant", "tool"})


def is_swe_agent(path: Path) -> bool:
    """A SWE-agent ``.traj`` file, or a directory holding some."""
    return path.suffix == ".traj" or (path.is_dir() and any(path.glob("*.traj")))


def read_swe_agent(path: Path) -> list[ChatSession]:
    """SWE-agent trajectories (``.traj``: ``history[]`` of ``{role, content}`` messages) as chat
    sessions: every assistant message is one model call whose prompt is the history before it
    (so successive calls share a growing prefix, as the agent sent them). Tool messages are sent
    with the ``tool`` role.

    Raises:
        TraceError: a file that is not JSON or has no usable history (names file and field).
    """
    if not path.exists():
        raise TraceError(f"{path}: no such trace file or directory")
    files = sorted(path.glob("*.traj")) if path.is_dir() else [path]
    if not files:
        raise TraceError(f"{path}: no SWE-agent trajectories (*.traj)")
    sessions = []
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TraceError(f"{f}: not a readable trajectory ({exc})") from None
        history = doc.get("history") if isinstance(doc, dict) else None
        if not isinstance(history, list):
            raise TraceError(f"{f}: field 'history' must be a list of messages")
        messages: list[dict[str, str]] = []
        turns = []
        for i, m in enumerate(history):
            role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
            if role not in SWE_AGENT_ROLES or not isinstance(content, str):
                raise TraceError(f"{f}: history[{i}] must have a role in {sorted(SWE_AGENT_ROLES)} and text content")
            if role == "assistant" and messages:
                turns.append(ChatTurn(messages=tuple(messages), answer_chars=len(content)))
            messages.append({"role": role, "content": content})
        if turns:
            sessions.append(ChatSession(session_id=f.stem, turns=tuple(turns)))
    return sessions
