"""Four-layer validation (DESIGN.md §4): each check fails on a real stored object, in order."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from engine.cache.validation import (
    GroupIntersection,
    KernelContract,
    LayoutFingerprint,
    ValidationFailure,
    ValidationLayer,
    check_alignment,
    check_granularity,
    check_kernel_contract,
    intersect_groups,
    validate,
)
from engine.events import Reason

KV_AXES = ("layer", "kv", "token", "head", "dim")
REVISION = "rev-a"
ABI = 1


def kv_pool(
    *,
    num_blocks: int = 4,
    layers: int = 2,
    unit: int = 16,
    heads: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float16,
) -> Tensor:
    """A paged KV pool ``[N, n_layers, 2, U, H_kv, D]`` as ``PagedKVForm`` allocates it, filled
    with distinct values so that a permuted copy really moves data."""
    shape = (num_blocks, layers, 2, unit, heads, head_dim)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape).to(dtype)


def fingerprint(
    pool: Tensor, axes: tuple[str, ...] = KV_AXES, abi: int = ABI, revision: str = REVISION
) -> LayoutFingerprint:
    return LayoutFingerprint.of(pool, axis_order=axes, kernel_abi=abi, model_revision=revision)


def contract_for(pool: Tensor, **changes: object) -> KernelContract:
    """The contract of a kernel written for exactly this pool's layout, with ``changes``."""
    return KernelContract(layout=dataclasses.replace(fingerprint(pool), **changes))  # type: ignore[arg-type]


def arena_pool(shape: tuple[int, ...], dtype: torch.dtype, header_elements: int) -> Tensor:
    """A pool carved out of one arena buffer after a header of ``header_elements`` elements."""
    numel = torch.Size(shape).numel()
    arena = torch.zeros(header_elements + numel, dtype=dtype)
    return arena[header_elements:].view(shape)


# --- layer 2: kernel contract -----------------------------------------------------------------


def test_matching_pool_passes_the_contract() -> None:
    pool = kv_pool()
    assert check_kernel_contract(fingerprint(pool), contract_for(pool)) is None
    assert fingerprint(pool).block_shape == (2, 2, 16, 2, 8)


def test_float16_pool_read_by_float32_kernel_is_layout_mismatch() -> None:
    pool = kv_pool(dtype=torch.float16)
    failure = check_kernel_contract(fingerprint(pool), contract_for(pool, dtype=torch.float32))
    assert failure is not None
    assert failure.layer == ValidationLayer.KERNEL_CONTRACT
    assert failure.reason == Reason.LAYOUT_MISMATCH
    assert failure.detail == "dtype: expected torch.float32, got torch.float16"


@pytest.mark.parametrize("unit", [16, 2])  # with U = 2 the permuted block even has the same shape
def test_token_major_pool_against_kv_major_kernel_is_layout_mismatch(unit: int) -> None:
    kv_major = kv_pool(unit=unit)  # [N, layer, kv, token, head, dim]
    # the same KV written token-major: [N, layer, token, kv, head, dim]
    token_major = kv_major.permute(0, 1, 3, 2, 4, 5).contiguous()
    assert torch.equal(token_major[1, 0, 1, 0], kv_major[1, 0, 0, 1])  # the same KV, moved
    stored = fingerprint(token_major, axes=("layer", "token", "kv", "head", "dim"))
    failure = check_kernel_contract(stored, contract_for(kv_major))
    assert failure is not None and failure.reason == Reason.LAYOUT_MISMATCH
    assert failure.detail.startswith(
        "axis_order: expected ('layer', 'kv', 'token', 'head', 'dim'), "
        "got ('layer', 'token', 'kv', 'head', 'dim')"
    )
    assert ("block_shape" in failure.detail) == (unit != 2)


def test_other_head_dim_is_layout_mismatch_naming_block_shape() -> None:
    stored = kv_pool(head_dim=16)
    failure = check_kernel_contract(fingerprint(stored), contract_for(kv_pool(head_dim=8)))
    assert failure is not None and failure.reason == Reason.LAYOUT_MISMATCH
    assert failure.detail == "block_shape: expected (2, 2, 16, 2, 8), got (2, 2, 16, 2, 16)"


def test_kernel_abi_bump_is_layout_mismatch() -> None:
    pool = kv_pool()
    failure = check_kernel_contract(fingerprint(pool, abi=1), contract_for(pool, kernel_abi=2))
    assert failure is not None and failure.reason == Reason.LAYOUT_MISMATCH
    assert failure.detail == "kernel_abi: expected 2, got 1"


def test_model_revision_changed_wins_over_layout() -> None:
    pool = kv_pool(dtype=torch.float16)
    stored = fingerprint(pool, revision="rev-a")
    failure = check_kernel_contract(stored, contract_for(pool, model_revision="rev-b"))
    assert failure is not None and failure.reason == Reason.MODEL_REVISION_CHANGED
    assert failure.detail == "model_revision: expected 'rev-b', got 'rev-a'"
    both = check_kernel_contract(
        stored, contract_for(pool, model_revision="rev-b", dtype=torch.bfloat16)
    )
    assert both is not None and both.reason == Reason.MODEL_REVISION_CHANGED
    assert (
        both.detail.startswith("model_revision:")
        and "; dtype: expected torch.bfloat16" in both.detail
    )


def test_every_fingerprint_field_is_compared() -> None:
    pool = kv_pool()
    other = {
        "dtype": torch.float32,
        "block_shape": (2, 2, 16, 2, 16),
        "axis_order": ("layer", "token", "kv", "head", "dim"),
        "kernel_abi": ABI + 1,
        "model_revision": "rev-z",
    }
    assert set(other) == {f.name for f in dataclasses.fields(LayoutFingerprint)}
    for name, value in other.items():
        failure = check_kernel_contract(fingerprint(pool), contract_for(pool, **{name: value}))
        assert failure is not None and failure.detail.startswith(f"{name}:"), name


def test_fingerprint_rejects_inconsistent_declarations() -> None:
    pool = kv_pool()
    with pytest.raises(ValueError, match="names 4 axes"):
        LayoutFingerprint.of(pool, axis_order=KV_AXES[:4], kernel_abi=ABI, model_revision=REVISION)
    with pytest.raises(ValueError, match="distinct"):
        LayoutFingerprint.of(
            pool,
            axis_order=("layer", "kv", "kv", "head", "dim"),
            kernel_abi=ABI,
            model_revision=REVISION,
        )
    with pytest.raises(ValueError, match="leading block axis"):
        LayoutFingerprint.of(
            torch.tensor(1.0), axis_order=(), kernel_abi=ABI, model_revision=REVISION
        )
    with pytest.raises(ValueError, match="model_revision"):
        LayoutFingerprint.of(pool, axis_order=KV_AXES, kernel_abi=ABI, model_revision="")
    with pytest.raises(ValueError, match="power of two"):
        KernelContract(layout=fingerprint(pool), vector_bytes=12)


# --- layer 4: alignment -----------------------------------------------------------------------


def test_aligned_pool_and_each_block_pass() -> None:
    pool = kv_pool(dtype=torch.float16, head_dim=8)  # rows of 16 bytes
    assert check_alignment(pool, contract_for(pool)) is None
    for block_id in range(pool.shape[0]):
        assert check_alignment(pool, contract_for(pool), block_id=block_id) is None


def test_pool_one_element_into_its_arena_is_misaligned_at_the_offset() -> None:
    shape = (4, 2, 2, 16, 2, 4)  # float32 rows of 16 bytes: only the offset is wrong
    pool = arena_pool(shape, torch.float32, header_elements=1)
    assert pool.storage_offset() == 1
    contract = contract_for(pool)
    failure = check_alignment(pool, contract)
    assert (
        failure is not None
        and failure.layer == ValidationLayer.ALIGNMENT
        and failure.reason == Reason.MISALIGNED
    )
    assert failure.detail == (
        "pool: byte offset 4 (storage offset 1 elements × 4 bytes) is not a multiple of 16 bytes"
    )
    block = check_alignment(pool, contract, block_id=2)  # 1 + 2 blocks × 512 elements in
    assert block is not None
    assert block.detail.startswith("block 2: byte offset 4100 (storage offset 1025 elements")
    assert check_alignment(arena_pool(shape, torch.float32, header_elements=4), contract) is None


def test_head_dim_3_float32_rows_are_misaligned_at_the_head_stride() -> None:
    pool = kv_pool(dtype=torch.float32, head_dim=3)
    failure = check_alignment(pool, contract_for(pool))
    assert failure is not None and failure.reason == Reason.MISALIGNED
    assert failure.detail == "pool: stride of axis 4 (head) is 12 bytes, not a multiple of 16 bytes"


def test_one_head_of_3_float32_is_misaligned_at_the_row_extent() -> None:
    # with a single head per token and one token per page only the row length is wrong
    pool = torch.zeros((4, 1, 2, 1, 1, 4))[..., :3]  # rows padded to 16 bytes, 12 used
    failure = check_alignment(pool, contract_for(pool))
    assert failure is not None and failure.reason == Reason.MISALIGNED
    assert failure.detail == (
        "pool: innermost extent of axis 5 (dim) is 12 bytes (3 × 4), not a multiple of 16 bytes"
    )


def test_head_major_storage_seen_as_head_dim_rows_is_not_contiguous() -> None:
    head_major = torch.zeros((4, 2, 2, 16, 8, 2), dtype=torch.float16)  # [..., D, H] in memory
    pool = head_major.transpose(-1, -2)  # presented as [..., H, D]
    failure = check_alignment(pool, contract_for(pool))
    assert failure is not None and failure.reason == Reason.MISALIGNED
    assert (
        failure.detail
        == "pool: innermost axis 5 (dim) has stride 2 elements, expected 1 (contiguous rows)"
    )


def test_int8_pool_with_misaligned_scales_is_misaligned() -> None:
    pool = torch.zeros((4, 2, 2, 16, 4, 16), dtype=torch.int8)  # rows of 16 bytes
    contract = contract_for(pool)
    good_scales = torch.ones((4, 2, 2, 16, 4), dtype=torch.float32)  # one per head: 16-byte rows
    assert check_alignment(pool, contract, scales=good_scales) is None
    assert check_alignment(pool, contract, scales=good_scales, block_id=3) is None
    assert check_alignment(pool, contract, scales=torch.tensor(0.5)) is None  # per-tensor scale

    bad_scales = arena_pool((4, 2, 2, 16, 4), torch.float32, header_elements=1)
    failure = check_alignment(pool, contract, scales=bad_scales)
    assert failure is not None and failure.reason == Reason.MISALIGNED
    assert failure.detail.startswith("scales of pool: byte offset 4 ")
    block = check_alignment(pool, contract, scales=bad_scales, block_id=1)
    assert block is not None and block.detail.startswith("scales of block 1: byte offset ")


def test_block_id_outside_the_pool_raises() -> None:
    pool = kv_pool()
    with pytest.raises(ValueError, match="block_id 4 is outside the pool"):
        check_alignment(pool, contract_for(pool), block_id=4)
    with pytest.raises(ValueError, match="outside the scales"):
        check_alignment(pool, contract_for(pool), scales=torch.ones(2, 4), block_id=3)


# --- layer 1: granularity ---------------------------------------------------------------------


def test_resume_point_off_the_unit_is_below_granularity() -> None:
    failure = check_granularity(40, 16)
    assert failure is not None and failure.layer == ValidationLayer.GRANULARITY
    assert failure.reason == Reason.BELOW_GRANULARITY
    assert failure.detail == (
        "resume point 40 tokens is not a multiple of the unit U = 16 tokens (the point below is 32)"
    )


def test_resume_point_without_a_stored_checkpoint_is_below_granularity() -> None:
    # recurrent-state checkpoints by token position, taken at 32 and 64 only
    checkpoints = {32: torch.zeros(2, 4, 8), 64: torch.zeros(2, 4, 8)}
    failure = check_granularity(48, 16, stored_at=checkpoints.__contains__)
    assert failure is not None and failure.reason == Reason.BELOW_GRANULARITY
    assert failure.detail.startswith("no stored state at 48 tokens")
    assert check_granularity(64, 16, stored_at=checkpoints.__contains__) is None


def test_granularity_ok_cases_and_bad_inputs() -> None:
    assert check_granularity(48, 16) is None

    def never_asked(position: int) -> bool:
        raise AssertionError("L = 0 needs no stored state")

    assert check_granularity(0, 16, stored_at=never_asked) is None
    with pytest.raises(ValueError, match="resume_tokens"):
        check_granularity(-16, 16)
    with pytest.raises(ValueError, match="unit_tokens"):
        check_granularity(16, 0)


# --- layer 3: group intersection --------------------------------------------------------------


def test_groups_that_disagree_lower_to_the_minimum_naming_it() -> None:
    resume, failure = intersect_groups({"csa": 64, "hca": 32})
    assert resume == 32
    assert failure is not None and failure.layer == ValidationLayer.GROUP_INTERSECTION
    assert failure.reason == Reason.GROUP_DISAGREE
    assert (
        failure.detail
        == "group 'hca' allows 32 tokens, below group 'csa' at 64 tokens; resume point lowered to 32 tokens"
    )


def test_groups_that_agree_pass() -> None:
    assert intersect_groups({"csa": 64, "hca": 64}) == GroupIntersection(64, None)
    assert intersect_groups({"full": 48}, tp_usable=[48, 48]) == GroupIntersection(48, None)


def test_group_missing_its_tail_vetoes_to_zero() -> None:
    resume, failure = intersect_groups({"csa": 64, "hca": 64}, vetoes={"hca": Reason.TAIL_MISSING})
    assert resume == 0
    assert failure is not None and failure.reason == Reason.TAIL_MISSING
    assert (
        failure.detail == "group 'hca' (tail_missing) vetoes reuse; resume point forced to 0 tokens"
    )
    resume, failure = intersect_groups(
        {"csa": 64, "hca": 64}, vetoes={"csa": Reason.IN_FLIGHT_SWAP, "hca": Reason.TAIL_MISSING}
    )
    assert resume == 0 and failure is not None and failure.reason == Reason.IN_FLIGHT_SWAP
    assert "'hca' (tail_missing)" in failure.detail


def test_tensor_parallel_rank_lowers_to_its_minimum_naming_it() -> None:
    resume, failure = intersect_groups({"csa": 64, "hca": 64}, tp_usable=[64, 48])
    assert resume == 48
    assert failure is not None and failure.reason == Reason.GROUP_DISAGREE
    assert failure.detail.startswith("tensor-parallel rank 1 allows 48 tokens, below the 64 tokens")


def test_intersection_rejects_caller_errors() -> None:
    with pytest.raises(ValueError, match="at least one"):
        intersect_groups({})
    with pytest.raises(ValueError, match="unknown group 'swa'"):
        intersect_groups({"csa": 64}, vetoes={"swa": Reason.TAIL_MISSING})
    with pytest.raises(ValueError, match="other than 'none'"):
        intersect_groups({"csa": 64}, vetoes={"csa": Reason.NONE})
    with pytest.raises(ValueError, match="rank 0"):
        intersect_groups({"csa": 64}, tp_usable=[-1])
    with pytest.raises(ValueError, match="must not be 'none'"):
        ValidationFailure(layer=ValidationLayer.ALIGNMENT, reason=Reason.NONE, detail="")


# --- all four, in order -----------------------------------------------------------------------


def test_validate_reports_the_first_failing_layer_in_order() -> None:
    pool = kv_pool(dtype=torch.float32, head_dim=4)
    contract = contract_for(pool)
    checkpoints = {32: torch.zeros(1), 48: torch.zeros(1)}
    good = {
        "resume_tokens": 48,
        "unit_tokens": 16,
        "stored_at": checkpoints.__contains__,
        "stored": fingerprint(pool),
        "contract": contract,
        "groups": intersect_groups({"csa": 64, "hca": 48}),  # disagree, but not below 48
        "tensor": pool,
        "block_id": 1,
    }
    broken = {
        "resume_tokens": 40,  # layer 1
        "stored": fingerprint(pool, revision="rev-old"),  # layer 2
        "groups": intersect_groups({"csa": 64, "hca": 32}),  # layer 3
        "tensor": arena_pool(tuple(pool.shape), torch.float32, header_elements=1),  # layer 4
    }
    expected = [
        (ValidationLayer.GRANULARITY, Reason.BELOW_GRANULARITY),
        (ValidationLayer.KERNEL_CONTRACT, Reason.MODEL_REVISION_CHANGED),
        (ValidationLayer.GROUP_INTERSECTION, Reason.GROUP_DISAGREE),
        (ValidationLayer.ALIGNMENT, Reason.MISALIGNED),
    ]
    args = {**good, **broken}
    for name, (layer, reason) in zip(broken, expected, strict=True):
        failure = validate(**args)  # type: ignore[arg-type]
        assert failure is not None and (failure.layer, failure.reason) == (layer, reason), name
        args[name] = good[name]  # repair this layer; the next one now fails first
    assert validate(**args) is None  # type: ignore[arg-type]


def test_validate_rejects_a_point_every_group_is_below() -> None:
    pool = kv_pool()
    with pytest.raises(ValueError, match="above the 32 tokens every group agreed on"):
        validate(
            resume_tokens=48,
            unit_tokens=16,
            stored=fingerprint(pool),
            contract=contract_for(pool),
            tensor=pool,
            groups=intersect_groups({"csa": 32, "hca": 32}),
        )


def test_failure_renders_layer_and_reason() -> None:
    failure = check_granularity(40, 16)
    assert failure is not None
    assert str(failure).startswith(
        "layer 1 (granularity): below_granularity: resume point 40 tokens"
    )
