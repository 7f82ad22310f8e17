"""Every lookup and every request compared with a brute-force reason oracle (issue 20, item 5).

The oracle (tests/engine/reason_oracle*.py) reads only the raw contents of the pools and tiers
and restates the resume rules; Hypothesis draws scenarios over the three tiny families (small
pools, host and disk tiers, offload, prefetch, restarts, every fault kind, Tail-Replay on and
off, the runtime with concurrent requests). Each scenario's lookups (``PrefixCache.lookup``) and
requests (their ``cache_lookup`` and ``request`` events) must agree with the oracle on outcome,
usable tokens and reason per form, and on L*, the limiting form(s) and reason; the cache's
invariants are checked after every step and warm = cold on a sample of scores.

Profiles: the default compares at least :data:`MIN_LOOKUPS` lookups;
``KVSCOPE_ORACLE_PROFILE=oracle-long`` runs ten times the scenarios.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from tests.engine.reason_oracle_compare import Tally
from tests.engine.reason_oracle_driver import Scenario, U, run_scenario, scenarios
from tests.engine.reason_oracle_examples import EXAMPLES as COVERING

LONG = os.environ.get("KVSCOPE_ORACLE_PROFILE") == "oracle-long"
EXAMPLES = 1600 if LONG else 160
LOOKUPS_PER_BATCH = 40
MIN_LOOKUPS = 2000
ORACLE_MODULES = sorted(Path(__file__).parent.glob("reason_oracle*.py"))
FORBIDDEN_MODULES = ("coordinator", "planner", "swap", "verdicts", "tail_replay")
FORBIDDEN_NAMES = ("resume_at_most", "loss_reason", "needed_keys", "plan_resume")

TALLY = Tally()
COVERED = (
    "admission:tail_replay", "admission:swap_in", "admission:exact", "replayed:linear_checkpoint_missing",
    "recovered:kv_evicted", "invalidated:in_flight_swap", "invalidated:epoch_changed", "invalidated:tier_incomplete",
    "invalidated:offload_corrupt", "invalidated:group_disagree", "invalidated:recovery_cap_reached",
    "invalidated:layout_mismatch", "invalidated:model_revision_changed",
)  # fmt: skip
"""What the default profile must have compared at least once (else it tests less than it says)."""
TAIL_REPLAY = Scenario(
    "qwen3_next-tiny",
    {"unit_tokens": U, "checkpoint_interval_tokens": 64, "max_prefill_chunk_tokens": 64, "full_kv_blocks": 30,
     "swa_blocks": 20, "linear_checkpoints": 4, "compressed_blocks": 16, "tail_slots": 4, "tail_replay": "on",
     "replay_min_tokens": 16, "replay_max_tokens": 64, "replay_fraction": 0.1, "swap_in_wait": True},
    "none", "none", ((128, 1),),
    (("score", 0, "all", 0, 1, 1), ("score", 0, 80, 5, 2, 1), ("lookups", 0, 96, 5, 3, 1),
     ("followup", 0, 96, 17, 4, 2), ("generate", 0, 112, 5, 5, 3)),
    LOOKUPS_PER_BATCH,
)  # fmt: skip
"""A request admitted with Tail-Replay (the random draws rarely give one: its point must fall
between two linear checkpoints with every other form stored there)."""


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
    database=None,
    phases=[
        Phase.explicit,
        Phase.generate,
    ],  # no shrinking: a scenario that raises is reported as drawn
)
@given(scenarios(lookups_per_batch=LOOKUPS_PER_BATCH))
@example(TAIL_REPLAY)
def _each_scenario(scenario) -> None:
    run_scenario(scenario, TALLY)


for _covering in COVERING:  # every COVERED outcome, whatever the random draws are
    _each_scenario = example(_covering)(_each_scenario)


def test_every_lookup_and_request_agrees_with_the_oracle() -> None:
    _each_scenario()
    print(f"{TALLY.lookups} lookups, {TALLY.requests} requests compared; seen: {dict(TALLY.seen)}")
    assert TALLY.lookups >= (10 if LONG else 1) * MIN_LOOKUPS, (
        f"only {TALLY.lookups} lookups compared"
    )
    missing = [key for key in COVERED if not TALLY.seen[key]]
    assert not missing, f"the profile never compared {missing}"
    assert not TALLY.mismatches, (
        f"{len(TALLY.mismatches)} mismatches over {TALLY.lookups} lookups and {TALLY.requests} requests:\n"
        + TALLY.render()
    )


@pytest.mark.parametrize("path", ORACLE_MODULES, ids=lambda p: p.name)
def test_the_oracle_shares_no_resume_logic_with_the_engine(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert not any(node.module == f"engine.cache.{m}" for m in FORBIDDEN_MODULES), (
                f"{path.name} imports {node.module}"
            )
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert not any(alias.name == f"engine.cache.{m}" for m in FORBIDDEN_MODULES), (
                    f"{path.name} imports {alias.name}"
                )
        name = (
            node.attr
            if isinstance(node, ast.Attribute)
            else node.id
            if isinstance(node, ast.Name)
            else None
        )
        assert name not in FORBIDDEN_NAMES, f"{path.name} uses {name}"
