"""Tile-COO: a linear's fp16 outliers, bucketed by the dense kernels' tiles (docs/tile-coo.md).

A CSR matrix run as a separate SpMM reloads the activations and costs more than its share.
Tile-COO stores the outliers where the dense GEMM already is: bucket (bn, bk) holds the
outliers of rows 32 bn .. 32 bn + 31 (one row tile, the rows one warp owns in both GEMM
kernels) and packed input channels 64 bk .. 64 bk + 63 (two k-tiles), so a CTA finds its
own outliers with one lookup and multiplies them by the activations already in its tile.

    start   int32 [NBn, NBk]   first entry of each bucket
    count   int32 [NBn, NBk]   entries in each bucket
    entries uint8 [Q, 16]      one 16-byte entry (one vector load) per four outliers:

        bytes 0-7    four fp16 values (slot i at bytes 2i, 2i+1)
        bytes 8-11   four 8-bit tile-local rows: the index word the four values share
        byte  12     the 8-bit bucket-local column, the same for all four slots
        byte  13     which slots are real (bit i = slot i); the others are padding:
                     value +0, row 0
        bytes 14-15  zero

Each column's outliers in a bucket fill ceil(n / 4) entries, so four values share one
index word and one activation gather. Entries of a bucket are arranged (`_arrange`) for
the kernel's warp step - four entries at once, lane = 8 * entry + token:

  * gathers without bank conflicts: the four entries of a step read activation words of
    four different banks, or the same word (the activation tile is K-major with 128-byte
    rows and a 16-byte XOR swizzle, so the bank of column c depends on (c >> 2) & 3 and
    on the token only through the swizzle); a step conflicts only when one bank class
    has run out of partners (the tail of a bucket whose columns crowd into one class);
  * adds without collisions: within a step, each slot position holds four distinct rows,
    so the four entries add into one accumulator per warp in the same instruction
    (always possible: each row occurs at most once per entry, and a bipartite graph of
    degree <= 4 has a 4-edge-colouring - König);
  * balance: steps are ordered by decreasing work, so warps dealt steps round-robin
    receive equal work to within one step.

Column indices are packed positions: the dense codes' column order (`perm`, natural
channel -> packed column; identity today, since reordering and act-order are folded into
the weights before packing) including the padding of K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qoqtool.quantizers.outliers import SparseOutliers

BUCKET_N = 32  # rows per bucket: one 32-row tile
BUCKET_K = 64  # packed input channels per bucket: two 32-wide k-tiles
SLOTS = 4  # outliers per entry (one column, four rows)
ENTRY_BYTES = 16  # one 128-bit load
STEP = 4  # entries a warp handles at once (lane = 8 * entry + token)
WORD_BANKS = 4  # activation words of one 16-byte swizzle chunk: the bank classes of a column
FORMAT = "tile-coo-v1"


@dataclass
class TileCOO:
    """One linear's outliers in Tile-COO. shape is the logical [N, K]; k_padded the packed K."""

    entries: torch.Tensor  # uint8 [Q, 16]
    start: torch.Tensor  # int32 [NBn, NBk]
    count: torch.Tensor  # int32 [NBn, NBk]
    shape: tuple[int, int]
    k_padded: int

    @property
    def nnz(self) -> int:
        return int((self.entries[:, 13:14] >> torch.arange(SLOTS, dtype=torch.uint8) & 1).sum())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"tc_entries": self.entries, "tc_start": self.start, "tc_count": self.count}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], shape, k_padded: int) -> "TileCOO":
        """Rebuild and validate (raises ValueError naming the first problem)."""
        tc = cls(tensors["tc_entries"], tensors["tc_start"], tensors["tc_count"], tuple(shape), int(k_padded))
        validate(tc)
        return tc

    def meta(self) -> dict:
        return {"format": FORMAT, "bucket": [BUCKET_N, BUCKET_K], "nnz": self.nnz, "entries": int(self.entries.shape[0])}


def buckets_of(n: int, k_padded: int) -> tuple[int, int]:
    return -(-n // BUCKET_N), -(-k_padded // BUCKET_K)


# ----------------------------------------------------------------------------------------
# Encoder
# ----------------------------------------------------------------------------------------
def encode(outliers: SparseOutliers, k_padded: int | None = None, perm: torch.Tensor | None = None) -> TileCOO:
    """SparseOutliers (natural coordinates) -> Tile-COO in the packed column order.

    perm: packed column of each natural input channel ([K] long), as the dense packing
    orders them; None is the identity. k_padded: the packed K (default K).
    """
    n, k = outliers.shape
    k_padded = k if k_padded is None else int(k_padded)
    if k_padded < k:
        raise ValueError(f"k_padded {k_padded} is smaller than K = {k}")
    rows = outliers.rows.long().cpu()
    cols = outliers.cols.long().cpu()
    if perm is not None:
        perm = perm.long().cpu()
        if perm.shape != (k,) or perm.min() < 0 or perm.max() >= k_padded or perm.unique().numel() != k:
            raise ValueError(f"perm must map the {k} channels one-to-one into 0..{k_padded - 1}")
        cols = perm[cols]
    values = outliers.values.cpu()
    nbn, nbk = buckets_of(n, k_padded)
    bucket = (rows // BUCKET_N) * nbk + cols // BUCKET_K

    entries, counts = [], torch.zeros(nbn * nbk, dtype=torch.int32)
    order = torch.argsort(bucket * (BUCKET_N * BUCKET_K) + (cols % BUCKET_K) * BUCKET_N + rows % BUCKET_N)
    rows, cols, values, bucket = rows[order], cols[order], values[order], bucket[order]
    bounds = torch.searchsorted(bucket, torch.arange(nbn * nbk + 1))
    for b in torch.nonzero(bounds[1:] > bounds[:-1])[:, 0].tolist():
        lo, hi = int(bounds[b]), int(bounds[b + 1])
        quads = _quads(rows[lo:hi] % BUCKET_N, cols[lo:hi] % BUCKET_K, values[lo:hi])
        arranged = _arrange(quads)
        entries.extend(arranged)
        counts[b] = len(arranged)
    start = torch.cumsum(counts, 0) - counts
    return TileCOO(_entry_table(entries), start.int().reshape(nbn, nbk), counts.reshape(nbn, nbk), (n, k), k_padded)


@dataclass
class _Quad:
    col: int  # bucket-local column
    rows: list  # [SLOTS] tile-local rows (None: padding)
    values: list  # [SLOTS] fp16 bit patterns as python ints

    @property
    def real(self) -> int:
        return sum(r is not None for r in self.rows)


def _quads(rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> list[_Quad]:
    """Split one bucket's outliers (sorted by column, then row) into quads per column."""
    bits = values.view(torch.int16).tolist()
    rows, cols = rows.tolist(), cols.tolist()
    quads, i = [], 0
    while i < len(rows):
        j = i
        while j < len(rows) and j - i < SLOTS and cols[j] == cols[i]:
            j += 1
        pad = SLOTS - (j - i)
        quads.append(_Quad(cols[i], rows[i:j] + [None] * pad, [b & 0xFFFF for b in bits[i:j]] + [0] * pad))
        i = j
    return quads


def _arrange(quads: list[_Quad]) -> list[_Quad]:
    """Order one bucket's quads into warp steps and colour their slots (module docstring)."""
    steps = _steps(quads)
    for step in steps:
        _colour_slots(step)
    # Full steps first, heaviest first: warps dealt steps round-robin get equal work to
    # within one step; a short step (fewer than four entries) can only be the last.
    steps.sort(key=lambda s: (len(s) < STEP, -sum(q.real for q in s)))
    return [q for step in steps for q in step]


def bank_class(col: int) -> int:
    """Which bank of its 16-byte swizzle chunk column `col`'s activation word sits in."""
    return (col >> 2) % WORD_BANKS


def _steps(quads: list[_Quad]) -> list[list[_Quad]]:
    """Group quads in fours (the last step of a bucket may be shorter) so that each step
    reads at most one activation word per bank class: quads of one word share it, words
    of different classes sit in different banks. First fit in column order: a step takes
    the next word whose class it does not hold yet (neighbouring words differ in class, so
    this is column order wherever column order is conflict-free); a quad that conflicts
    only when no other is left."""
    words: dict[int, list[_Quad]] = {}
    for q in sorted(quads, key=lambda q: q.col):
        words.setdefault(q.col >> 2, []).append(q)
    steps = []
    while words:
        step: list[_Quad] = []
        owner: dict[int, int] = {}  # bank class -> the word that uses it in this step
        for w in list(words):
            if len(step) < STEP and owner.setdefault(w % WORD_BANKS, w) == w:
                room = STEP - len(step)
                step, words[w] = step + words[w][:room], words[w][room:]
        while len(step) < STEP and any(words.values()):  # only conflicting quads are left
            w = max(words, key=lambda w: len(words[w]))
            step.append(words[w].pop())
        words = {w: qs for w, qs in words.items() if qs}
        steps.append(step)
    return steps


def gather_conflicts(step: list[_Quad]) -> int:
    """Extra shared-memory wavefronts of one step's activation gather (0: conflict-free)."""
    words_by_bank: dict[int, set] = {}
    for q in step:
        words_by_bank.setdefault(bank_class(q.col), set()).add(q.col >> 2)
    return max((len(w) for w in words_by_bank.values()), default=1) - 1


def _colour_slots(step: list[_Quad]) -> None:
    """Permute each quad's slots so that every slot position holds distinct real rows.

    Proper edge colouring of the bipartite graph quads x rows with SLOTS colours, by
    alternating-path recolouring (König: degree <= SLOTS suffices)."""
    colour: dict[tuple[int, int], int] = {}  # (quad index, row) -> slot
    at_quad = [dict() for _ in step]  # slot -> row
    at_row: dict[int, dict] = {}  # row -> {slot: quad index}
    for qi, q in enumerate(step):
        for r in (r for r in q.rows if r is not None):
            rmap = at_row.setdefault(r, {})
            a = next(c for c in range(SLOTS) if c not in at_quad[qi])  # free at the quad
            b = next(c for c in range(SLOTS) if c not in rmap)  # free at the row
            if a not in rmap:
                b = a
            else:
                # flip the a/b alternating path that starts at the row, freeing a there
                path, node, on_row, c = [], r, True, a
                while True:
                    nxt = at_row[node].get(c) if on_row else at_quad[node].get(c)
                    if nxt is None:
                        break
                    path.append((nxt, node) if on_row else (node, nxt))
                    node, on_row, c = nxt, not on_row, (b if c == a else a)
                for qj, rj in path:
                    old = colour[(qj, rj)]
                    del at_quad[qj][old], at_row[rj][old]
                for qj, rj in path:
                    new = b if colour[(qj, rj)] == a else a
                    colour[(qj, rj)] = new
                    at_quad[qj][new] = rj
                    at_row[rj][new] = qj
                b = a
            colour[(qi, r)] = b
            at_quad[qi][b] = r
            rmap[b] = qi
    for qi, q in enumerate(step):
        value_of = {r: v for r, v in zip(q.rows, q.values) if r is not None}
        q.rows = [at_quad[qi].get(s) for s in range(SLOTS)]
        q.values = [value_of[r] if r is not None else 0 for r in q.rows]


def _entry_table(quads: list[_Quad]) -> torch.Tensor:
    """The 16-byte entries of `quads`, [Q, 16] uint8 (layout in the module docstring)."""
    table = torch.zeros(len(quads), ENTRY_BYTES, dtype=torch.uint8)
    if not quads:
        return table
    values = torch.tensor([q.values for q in quads], dtype=torch.int32).to(torch.int16)
    table[:, 0:8] = values.view(torch.uint8)
    table[:, 8:12] = torch.tensor([[r if r is not None else 0 for r in q.rows] for q in quads], dtype=torch.uint8)
    table[:, 12] = torch.tensor([q.col for q in quads], dtype=torch.uint8)
    table[:, 13] = torch.tensor([sum(1 << i for i, r in enumerate(q.rows) if r is not None) for q in quads], dtype=torch.uint8)
    return table


# ----------------------------------------------------------------------------------------
# Decoder and validator
# ----------------------------------------------------------------------------------------
def _fields(entries: torch.Tensor):
    values = entries[:, 0:8].contiguous().view(torch.float16)  # [Q, 4]
    rows = entries[:, 8:12].long()
    cols = entries[:, 12].long()
    real = (entries[:, 13:14] >> torch.arange(SLOTS, dtype=torch.uint8)) & 1  # [Q, 4]
    return values, rows, cols, real.bool()


def validate(tc: TileCOO) -> None:
    """Raise ValueError (one line) unless every offset and index stays inside its bounds."""
    n, k = tc.shape
    e, start, count = tc.entries, tc.start, tc.count
    nbn, nbk = buckets_of(n, tc.k_padded)
    if e.dtype != torch.uint8 or e.dim() != 2 or e.shape[1] != ENTRY_BYTES:
        raise ValueError(f"Tile-COO entries must be uint8 [Q, {ENTRY_BYTES}], got {e.dtype} {list(e.shape)}")
    for name, t in (("start", start), ("count", count)):
        if t.dtype != torch.int32 or tuple(t.shape) != (nbn, nbk):
            raise ValueError(f"Tile-COO {name} must be int32 [{nbn}, {nbk}], got {t.dtype} {list(t.shape)}")
    s, c = start.flatten().long(), count.flatten().long()
    q = e.shape[0]
    if (s < 0).any() or (c < 0).any():
        raise ValueError("a Tile-COO bucket has a negative start or count")
    if (s + c > q).any():
        raise ValueError(f"a Tile-COO bucket runs past the {q} entries")
    used = c > 0
    order = torch.argsort(s[used])
    ss, ee = s[used][order], (s + c)[used][order]
    if (ss[1:] < ee[:-1]).any():
        raise ValueError("two Tile-COO buckets share entries")
    if int(c.sum()) != q:
        raise ValueError(f"the Tile-COO buckets cover {int(c.sum())} of {q} entries")
    values, rows, cols, real = _fields(e)
    bucket = _entry_buckets(s, c, q)
    if (e[:, 14:16] != 0).any() or (e[:, 13] > 0xF).any() or (e[:, 13] == 0).any():
        raise ValueError("a Tile-COO entry has a bad slot mask or non-zero reserved bytes")
    if (rows >= BUCKET_N).any() or (cols >= BUCKET_K).any():
        raise ValueError("a Tile-COO entry indexes outside its tile")
    grow = (bucket // nbk)[:, None] * BUCKET_N + rows
    gcol = (bucket % nbk) * BUCKET_K + cols
    if ((grow >= n) & real).any() or (gcol >= tc.k_padded).any():
        raise ValueError("a Tile-COO entry indexes past the weight's rows or packed columns")
    pad = ~real
    if (values.view(torch.int16)[pad] != 0).any() or (rows[pad] != 0).any():
        raise ValueError("a Tile-COO padding slot is not (+0, row 0)")
    if not torch.isfinite(values[real].float()).all():
        raise ValueError("a Tile-COO value is not finite")
    key = (grow * tc.k_padded + gcol[:, None])[real]
    if key.unique().numel() != key.numel():
        raise ValueError("a Tile-COO outlier appears twice")


def _entry_buckets(s: torch.Tensor, c: torch.Tensor, q: int) -> torch.Tensor:
    """The bucket of each of the q entries, given valid starts s and counts c (flat)."""
    first = torch.repeat_interleave(torch.cumsum(c, 0) - c, c)
    at = s.repeat_interleave(c) + torch.arange(q) - first  # entry index of each run position
    bucket = torch.empty(q, dtype=torch.long)
    bucket[at] = torch.repeat_interleave(torch.arange(c.numel()), c)
    return bucket


def coordinates(tc: TileCOO) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, packed columns, fp16 values) of every real slot, in entry order (validates first)."""
    validate(tc)
    nbk = buckets_of(*tc.shape[:1], tc.k_padded)[1]
    bucket = _entry_buckets(tc.start.flatten().long(), tc.count.flatten().long(), tc.entries.shape[0])
    values, rows, cols, real = _fields(tc.entries)
    grow = (bucket // nbk)[:, None] * BUCKET_N + rows
    gcol = ((bucket % nbk) * BUCKET_K + cols)[:, None].expand_as(rows)
    return grow[real], gcol[real], values[real]


def decode(tc: TileCOO, perm: torch.Tensor | None = None) -> SparseOutliers:
    """Tile-COO -> SparseOutliers in natural coordinates; perm as given to `encode`."""
    n, k = tc.shape
    rows, cols, values = coordinates(tc)
    if perm is not None:
        natural = torch.full((tc.k_padded,), -1, dtype=torch.long)
        natural[perm.long()] = torch.arange(k)
        cols = natural[cols]
    if (cols < 0).any() or (cols >= k).any():
        raise ValueError("a Tile-COO outlier sits in a padding column")
    order = torch.argsort(rows * k + cols)
    return SparseOutliers(rows[order].int(), cols[order].int(), values[order].contiguous(), (n, k))


# ----------------------------------------------------------------------------------------
# Storage
# ----------------------------------------------------------------------------------------
def storage(tc: TileCOO) -> dict:
    """Bits of the section (entries, padding, bucket arrays) against CSR with 16-bit indices."""
    nnz, q = tc.nnz, tc.entries.shape[0]
    n = tc.shape[0]
    meta_bits = 32 * (tc.start.numel() + tc.count.numel())
    entry_bits = ENTRY_BYTES * 8 * q
    csr = csr_bits(nnz, n)
    return {
        "nnz": nnz,
        "entries": q,
        "padding_slots": SLOTS * q - nnz,
        "padding_share": (SLOTS * q - nnz) / max(SLOTS * q, 1),
        "bits": entry_bits + meta_bits,
        "bits_per_outlier": (entry_bits + meta_bits) / max(nnz, 1),
        "csr_bits": csr,
        "csr_bits_per_outlier": csr / max(nnz, 1),
    }


def csr_bits(nnz: int, rows: int) -> int:
    """CSR with fp16 values, 16-bit column indices and 32-bit row pointers."""
    return nnz * (16 + 16) + 32 * (rows + 1)


def arrangement_report(tc: TileCOO) -> tuple[int, int]:
    """(steps whose activation gather has a bank conflict, steps) over all buckets, where a
    step is four consecutive entries of a bucket (the kernel's warp step)."""
    conflicts = steps = 0
    cols = tc.entries[:, 12].tolist()
    for s, c in zip(tc.start.flatten().tolist(), tc.count.flatten().tolist()):
        for first in range(s, s + c, STEP):
            step = [_Quad(col, [], []) for col in cols[first : min(first + STEP, s + c)]]
            conflicts += gather_conflicts(step) > 0
            steps += 1
    return conflicts, steps


def summary(sections: dict[str, TileCOO], dense_bits: int, weights: int) -> dict:
    """What `qoqtool info` reports of a model's outliers: count, padding, bits per outlier
    against CSR, and bits per weight dense + outliers (dense_bits: the dense part's bits;
    weights: the number of quantized weights)."""
    figures = [storage(tc) for tc in sections.values()]
    nnz = sum(f["nnz"] for f in figures)
    bits = sum(f["bits"] for f in figures)
    csr = sum(f["csr_bits"] for f in figures)
    slots = SLOTS * sum(f["entries"] for f in figures)
    return {
        "format": FORMAT,
        "outliers": nnz,
        "share": nnz / max(weights, 1),
        "padding_share": (slots - nnz) / max(slots, 1),
        "bits_per_outlier": bits / max(nnz, 1),
        "csr16_bits_per_outlier": csr / max(nnz, 1),
        "bits_per_weight_dense": dense_bits / max(weights, 1),
        "bits_per_weight_with_outliers": (dense_bits + bits) / max(weights, 1),
        "bits_per_weight_with_csr16": (dense_bits + csr) / max(weights, 1),
    }
