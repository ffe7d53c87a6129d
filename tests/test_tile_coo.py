"""Tile-COO: exact round trips, the entry layout, the arrangement, and the validator."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qoqtool.packing import tile_coo as tc
from qoqtool.quantizers.outliers import SparseOutliers


def _sparse(mask: torch.Tensor, seed: int = 0) -> SparseOutliers:
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(mask.shape, generator=g) * 4).half().float()
    values[values == 0] = 1.0  # any fp16 is allowed; keep the set unambiguous to compare
    return SparseOutliers.from_mask(mask, values)


def _same(a: SparseOutliers, b: SparseOutliers) -> bool:
    return (
        a.shape == b.shape
        and torch.equal(a.rows, b.rows)
        and torch.equal(a.cols, b.cols)
        and torch.equal(a.values.view(torch.int16), b.values.view(torch.int16))
    )


def _pattern(kind: str, n: int, k: int, density: float, g: torch.Generator) -> torch.Tensor:
    """Sparsity patterns the kernels meet: scattered, salient rows/columns, empty and full tiles."""
    if kind == "uniform":
        return torch.rand(n, k, generator=g) < density
    if kind == "rows":  # clustered in a few rows
        rows = torch.rand(n, 1, generator=g) < 0.1
        return rows & (torch.rand(n, k, generator=g) < min(1.0, density * 10))
    if kind == "cols":  # clustered in a few input channels (large activations)
        cols = torch.rand(1, k, generator=g) < 0.1
        return cols & (torch.rand(n, k, generator=g) < min(1.0, density * 10))
    if kind == "tiles":  # some buckets full, the rest empty
        mask = torch.zeros(n, k, dtype=torch.bool)
        for bn in range(0, n, tc.BUCKET_N):
            for bk in range(0, k, tc.BUCKET_K):
                if torch.rand(1, generator=g) < 0.3:
                    mask[bn : bn + tc.BUCKET_N, bk : bk + tc.BUCKET_K] = True
        return mask
    raise ValueError(kind)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["uniform", "rows", "cols", "tiles"]),
    n=st.integers(1, 150),
    k=st.integers(1, 200),
    density=st.sampled_from([0.0, 0.003, 0.01, 0.05, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_random_patterns(kind, n, k, density, seed):
    """decode(encode(S)) is exactly S, for shapes that are not multiples of the tile too."""
    g = torch.Generator().manual_seed(seed)
    sparse = _sparse(_pattern(kind, n, k, density, g), seed)
    k_padded = -(-k // 32) * 32
    section = tc.encode(sparse, k_padded)
    assert section.nnz == sparse.nnz
    assert _same(tc.decode(section), sparse)


def test_round_trip_edge_cases():
    for mask in (
        torch.zeros(64, 128, dtype=torch.bool),  # no outlier at all
        torch.ones(32, 64, dtype=torch.bool),  # one full bucket
        torch.ones(33, 65, dtype=torch.bool),  # full, and one row / column into the next buckets
        torch.eye(70, 70, dtype=torch.bool),  # one per column: every entry mostly padding
    ):
        sparse = _sparse(mask)
        assert _same(tc.decode(tc.encode(sparse, -(-mask.shape[1] // 32) * 32)), sparse)


def test_round_trip_with_a_channel_permutation():
    """Column indices are packed positions: with `perm` an outlier sits where the dense
    code of its channel sits, and decoding with the same perm gives natural coordinates."""
    g = torch.Generator().manual_seed(3)
    n, k, kp = 40, 100, 128
    sparse = _sparse(torch.rand(n, k, generator=g) < 0.05)
    perm = torch.randperm(kp, generator=g)[:k]  # natural channel -> packed column (holes = padding)
    section = tc.encode(sparse, kp, perm)
    natural = tc.decode(section, perm)
    assert _same(natural, sparse)
    rows, cols, values = tc.coordinates(section)  # packed coordinates
    placed = torch.zeros(n, kp)
    placed[rows, cols] = values.float()
    dense = torch.zeros(n, kp)
    dense[:, perm] = sparse.to_dense()
    assert torch.equal(placed, dense)


def test_entry_layout_golden():
    """Bytes of one entry, written out by hand from the module docstring."""
    # three outliers in column 5 of bucket (1, 0): rows 33, 40, 63 -> tile rows 1, 8, 31
    rows = torch.tensor([33, 40, 63], dtype=torch.int32)
    cols = torch.tensor([5, 5, 5], dtype=torch.int32)
    values = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float16)
    section = tc.encode(SparseOutliers(rows, cols, values, (64, 64)))
    assert section.start.tolist() == [[0], [0]] and section.count.tolist() == [[0], [1]]
    entry = section.entries[0]
    slot_rows = entry[8:12].tolist()
    mask = int(entry[13])
    real = [s for s in range(4) if mask >> s & 1]
    assert len(real) == 3 and sorted(slot_rows[s] for s in real) == [1, 8, 31]
    for s in range(4):
        bits = int(entry[2 * s]) | int(entry[2 * s + 1]) << 8
        if s in real:
            expect = {1: 1.0, 8: -2.0, 31: 0.5}[slot_rows[s]]
            assert bits == torch.tensor([expect], dtype=torch.float16).view(torch.int16).item() & 0xFFFF
        else:
            assert bits == 0 and slot_rows[s] == 0  # padding: +0, row 0
    assert int(entry[12]) == 5 and entry[14:].tolist() == [0, 0]


def _steps_of(section):
    """The warp steps: four consecutive entries of one bucket."""
    for s, c in zip(section.start.flatten().tolist(), section.count.flatten().tolist()):
        for first in range(s, s + c, tc.STEP):
            yield section.entries[first : min(first + tc.STEP, s + c)]


@pytest.mark.parametrize("seed", range(4))
def test_steps_add_without_collisions(seed):
    """In every step, each slot position holds distinct real rows (König colouring)."""
    g = torch.Generator().manual_seed(seed)
    mask = _pattern("cols", 96, 256, 0.2, g) | _pattern("rows", 96, 256, 0.05, g)
    section = tc.encode(_sparse(mask, seed), 256)
    for step in _steps_of(section):
        for slot in range(tc.SLOTS):
            real = (step[:, 13] >> slot) & 1 == 1
            rows = step[real, 8 + slot]
            assert rows.unique().numel() == rows.numel()


def _column_order_conflicts(section):
    """Steps with gather conflicts if each bucket's entries were simply in column order."""
    total = 0
    for start, count in zip(section.start.flatten().tolist(), section.count.flatten().tolist()):
        cols = sorted(section.entries[start : start + count, 12].tolist())
        for first in range(0, count, tc.STEP):
            total += tc.gather_conflicts([tc._Quad(c, [], []) for c in cols[first : first + tc.STEP]]) > 0
    return total


@pytest.mark.parametrize("density", [0.005, 0.01, 0.03, 0.1])
def test_arrangement_avoids_gather_conflicts(density):
    """Scattered columns: in column order many steps gather two words from one bank; the
    arrangement never does worse and removes most of them where there is a choice."""
    g = torch.Generator().manual_seed(7)
    section = tc.encode(_sparse(torch.rand(512, 1024, generator=g) < density), 1024)
    conflicts, steps = tc.arrangement_report(section)
    naive = _column_order_conflicts(section)
    assert steps > 500 and conflicts <= naive
    if density <= 0.01:
        assert naive > steps // 10 and conflicts < 0.7 * naive


def test_conflicts_only_where_a_class_runs_out():
    """One entry in each of four words of one bank class: the step must conflict, and the
    report counts it (a fifth word in another class is taken first, conflict-free)."""
    mask = torch.zeros(32, 64, dtype=torch.bool)
    mask[:4, [0, 16, 32, 48]] = True  # (c >> 2) & 3 == 0 for all four columns
    assert tc.arrangement_report(tc.encode(_sparse(mask), 64)) == (1, 1)
    section = tc.encode(_sparse(mask), 64)
    assert tc.gather_conflicts([tc._Quad(int(c), [], []) for c in section.entries[:, 12]]) == 3
    # full words (eight entries each) pack four to a step of one word: no conflict
    mask[:, [0, 16, 32, 48]] = True
    assert tc.arrangement_report(tc.encode(_sparse(mask), 64)) == (0, 8)


def test_steps_are_balanced_heaviest_first():
    mask = torch.zeros(32, 64, dtype=torch.bool)
    mask[:, 0:16] = True  # 16 columns x 32 rows: 128 full entries, 32 steps
    mask[:3, 40] = True  # one partial entry
    section = tc.encode(_sparse(mask), 64)
    work = [int(((s[:, 13:14] >> torch.arange(4, dtype=torch.uint8)) & 1).sum()) for s in _steps_of(section)]
    assert work == sorted(work, reverse=True)


def test_storage_figures():
    """One full bucket: 512 entries of 128 bits + start and count (64 bits)."""
    section = tc.encode(_sparse(torch.ones(32, 64, dtype=torch.bool)), 64)
    s = tc.storage(section)
    assert s["nnz"] == 2048 and s["entries"] == 512 and s["padding_slots"] == 0
    assert s["bits"] == 512 * 128 + 64
    assert s["csr_bits"] == 2048 * 32 + 33 * 32


# -- the validator --------------------------------------------------------------------------
def _valid():
    g = torch.Generator().manual_seed(1)
    return tc.encode(_sparse(torch.rand(70, 130, generator=g) < 0.1), 160)


def _broken(change):
    section = _valid()
    section = tc.TileCOO(section.entries.clone(), section.start.clone(), section.count.clone(), section.shape, section.k_padded)
    change(section)
    return section


def _nonempty(section, which=0):
    return int(torch.nonzero(section.count.flatten() > 0)[which, 0])


def _count_past_the_end(s):
    s.count.view(-1)[_nonempty(s, -1)] += 5


def _start_past_the_end(s):
    s.start.view(-1)[_nonempty(s)] = 10**6


def _negative_start(s):
    s.start.view(-1)[_nonempty(s)] = -1


def _overlapping_buckets(s):
    s.start.view(-1)[_nonempty(s, 1)] = int(s.start.view(-1)[_nonempty(s, 0)])


def _row_outside_tile(s):
    s.entries[0, 8 : 8 + tc.SLOTS] = torch.where(s.entries[0, 8:12] == 0, 0, tc.BUCKET_N)
    s.entries[0, 8 + int(torch.nonzero((s.entries[0, 13] >> torch.arange(4, dtype=torch.uint8)) & 1)[0, 0])] = tc.BUCKET_N


def _col_outside_tile(s):
    s.entries[0, 12] = tc.BUCKET_K + 3


def _no_real_slot(s):
    s.entries[3, 13] = 0


def _reserved_bytes(s):
    s.entries[0, 15] = 1


@pytest.mark.parametrize(
    "change, message",
    [
        (_count_past_the_end, "runs past"),
        (_start_past_the_end, "runs past"),
        (_negative_start, "negative"),
        (_overlapping_buckets, "share entries"),
        (_row_outside_tile, "outside its tile"),
        (_col_outside_tile, "outside its tile"),
        (_no_real_slot, "slot mask"),
        (_reserved_bytes, "reserved"),
    ],
)
def test_validator_rejects(change, message):
    with pytest.raises(ValueError, match=message):
        tc.validate(_broken(change))
    with pytest.raises(ValueError, match=message):
        tc.decode(_broken(change))  # decoding validates first: never reads out of bounds


def test_validator_rejects_rows_past_the_weight():
    """Rows 64..69 exist in the last bucket of a 70-row weight, rows 70..95 do not."""
    section = _valid()
    last_row_bucket = section.count.shape[0] - 1
    b = int(torch.nonzero(section.count[last_row_bucket] > 0)[0, 0])
    first = int(section.start[last_row_bucket, b])
    entries = section.entries.clone()
    slot = int(torch.nonzero((entries[first, 13] >> torch.arange(4, dtype=torch.uint8)) & 1)[0, 0])
    entries[first, 8 + slot] = 31  # row 64 + 31 = 95 >= 70
    with pytest.raises(ValueError, match="past the weight"):
        tc.validate(tc.TileCOO(entries, section.start, section.count, section.shape, section.k_padded))


def test_validator_rejects_bad_padding_and_duplicates():
    section = tc.encode(_sparse(torch.eye(32, 64, dtype=torch.bool)), 64)  # one real slot per entry
    entries = section.entries.clone()
    pad = int(torch.nonzero(((entries[0, 13] >> torch.arange(4, dtype=torch.uint8)) & 1) == 0)[0, 0])
    entries[0, 2 * pad] = 1  # a padding slot with a value
    with pytest.raises(ValueError, match="padding"):
        tc.validate(tc.TileCOO(entries, section.start, section.count, section.shape, 64))
    entries = section.entries.clone()
    entries[1] = entries[0]  # the same outlier twice
    with pytest.raises(ValueError, match="twice"):
        tc.validate(tc.TileCOO(entries, section.start, section.count, section.shape, 64))


def test_validator_rejects_wrong_dtypes_and_shapes():
    section = _valid()
    with pytest.raises(ValueError, match="uint8"):
        tc.validate(tc.TileCOO(section.entries.int(), section.start, section.count, section.shape, section.k_padded))
    with pytest.raises(ValueError, match="int32"):
        tc.validate(tc.TileCOO(section.entries, section.start[:1], section.count, section.shape, section.k_padded))
    with pytest.raises(ValueError, match="int32"):
        tc.validate(tc.TileCOO(section.entries, section.start.long(), section.count, section.shape, section.k_padded))


def test_from_tensors_validates():
    section = _valid()
    tensors = section.tensors()
    again = tc.TileCOO.from_tensors(tensors, section.shape, section.k_padded)
    assert _same(tc.decode(again), tc.decode(section))
    tensors["tc_count"] = tensors["tc_count"] + 1
    with pytest.raises(ValueError):
        tc.TileCOO.from_tensors(tensors, section.shape, section.k_padded)
