"""The kernel weight layout: golden bytes derived by hand from docs/format.md, the mma
fragment definition of the PTX ISA, and exact round trips of every packed format."""

import pytest
import torch

from qoqtool.packing import layout
from qoqtool.packing.layout import PackedLayout
from qoqtool.quantizers.schemes import WeightQuantConfig, WeightScheme
from qoqtool.runtime.packed_linear import PackedLinear
from qoqtool.runtime.reference import QuantLinear

# ------------------------------------------------------------------------------------------
# Golden tests. The layout is a permutation of index bits (every dimension is a power of
# two), so it is pinned down by where a code at (0, 0) and at each single-bit row and
# column offset lands. Each entry below was derived by hand from docs/format.md:
#   nt = r // 32, i = (r % 32) // 8, g = r % 8          kt = c // 32, h = (c % 32) // 16,
#   t = (c % 16) // 4, j = c % 4                         lane = 4g + t
#   W4: byte 4i + j of the lane, low nibble if h = 0, high nibble if h = 1
#   W8: byte 8i + 4h + j of the lane
# A 64 x 64 matrix: two row tiles and two k-tiles, every other byte zero.

# (row, col, code)  ->  (nt, kt, lane, byte, byte value)
GOLDEN_W4 = [
    ((0, 0, 1), (0, 0, 0, 0, 0xB1)),  # shares its byte with (0, 16): high nibble 0xB
    ((0, 16, 11), (0, 0, 0, 0, 0xB1)),  # h = 1 -> high nibble of the same byte
    ((1, 0, 2), (0, 0, 4, 0, 0x02)),  # g = 1 -> lane 4
    ((2, 0, 3), (0, 0, 8, 0, 0x03)),  # g = 2 -> lane 8
    ((4, 0, 4), (0, 0, 16, 0, 0x04)),  # g = 4 -> lane 16
    ((8, 0, 5), (0, 0, 0, 4, 0x05)),  # i = 1 -> byte 4 (word 1)
    ((16, 0, 6), (0, 0, 0, 8, 0x06)),  # i = 2 -> byte 8 (word 2)
    ((0, 1, 7), (0, 0, 0, 1, 0x07)),  # j = 1 -> byte 1
    ((0, 2, 8), (0, 0, 0, 2, 0x08)),  # j = 2 -> byte 2
    ((0, 4, 9), (0, 0, 1, 0, 0x09)),  # t = 1 -> lane 1
    ((0, 8, 10), (0, 0, 2, 0, 0x0A)),  # t = 2 -> lane 2
    ((0, 32, 12), (0, 1, 0, 0, 0x0C)),  # kt = 1
    ((32, 0, 14), (1, 0, 0, 0, 0x0E)),  # nt = 1
    ((27, 45, 13), (0, 1, 15, 13, 0x0D)),  # i 3, g 3 / kt 1, h 0, t 3, j 1 -> lane 15, byte 13
    ((31, 63, 15), (0, 1, 31, 15, 0xF0)),  # i 3, g 7 / kt 1, h 1, t 3, j 3 -> lane 31, byte 15, high
]

GOLDEN_W8 = [
    ((0, 0, 1), (0, 0, 0, 0)),
    ((1, 0, 2), (0, 0, 4, 0)),  # g = 1 -> lane 4
    ((2, 0, 3), (0, 0, 8, 0)),
    ((4, 0, 4), (0, 0, 16, 0)),
    ((8, 0, 5), (0, 0, 0, 8)),  # i = 1 -> byte 8 (word 2)
    ((16, 0, 6), (0, 0, 0, 16)),  # i = 2 -> byte 16 (word 4)
    ((0, 1, 7), (0, 0, 0, 1)),
    ((0, 2, 8), (0, 0, 0, 2)),
    ((0, 4, 9), (0, 0, 1, 0)),  # t = 1 -> lane 1
    ((0, 8, 10), (0, 0, 2, 0)),
    ((0, 16, -11), (0, 0, 0, 4)),  # h = 1 -> byte 4 (word 1)
    ((0, 32, -12), (0, 1, 0, 0)),
    ((32, 0, -127), (1, 0, 0, 0)),
    ((27, 45, 13), (0, 1, 15, 25)),  # i 3, g 3 / kt 1, h 0, t 3, j 1 -> lane 15, byte 24 + 1
]

# Group parameters: byte 4g + i of a row tile's 32 bytes holds row 8i + g (one 32-bit word
# per lane group g carries its four rows). Written out for one tile:
GROUP_PARAM_ROWS = [0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
                    4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31]


def test_golden_w4():
    codes = torch.zeros(64, 64, dtype=torch.uint8)
    expected = torch.zeros(2, 2, 32, 16, dtype=torch.uint8)
    for (r, c, v), (nt, kt, lane, byte, value) in GOLDEN_W4:
        codes[r, c] = v
        expected[nt, kt, lane, byte] = value
    packed = layout.pack_w4(codes)
    assert torch.equal(packed, expected)
    assert torch.equal(layout.unpack_w4(expected), codes)


def test_golden_w8():
    codes = torch.zeros(64, 64, dtype=torch.int8)
    expected = torch.zeros(2, 2, 32, 32, dtype=torch.int8)
    for (r, c, v), (nt, kt, lane, byte) in GOLDEN_W8:
        codes[r, c] = v
        expected[nt, kt, lane, byte] = v
    assert torch.equal(layout.pack_w8(codes), expected)
    assert torch.equal(layout.unpack_w8(expected), codes)


def test_golden_group_params():
    rows = torch.arange(64, dtype=torch.uint8)[:, None]
    params = rows + torch.tensor([[0, 100]], dtype=torch.uint8)  # [64 rows, 2 groups]
    expected = torch.tensor(
        [[[32 * nt + r + 100 * grp for r in GROUP_PARAM_ROWS] for grp in range(2)] for nt in range(2)],
        dtype=torch.uint8,
    )
    assert torch.equal(layout.pack_group_params(params), expected)
    assert torch.equal(layout.unpack_group_params(expected), params)


def test_golden_progressive_linear():
    """A whole progressive linear, N = 8 rows (padded to 32), K = 40 (padded to 64), g = 32."""
    n, k = 8, 40
    codes = torch.zeros(n, 64, dtype=torch.uint8)
    codes[3, 0], codes[3, 16], codes[5, 39] = 9, 12, 2
    codes[:, 40:] = 1  # padding columns hold each row's zero point (1 in group 1)
    scale1 = torch.full((n, 2), 2, dtype=torch.uint8)
    scale1[3, 0] = 8
    zero = torch.tensor([[0, 1]] * n, dtype=torch.uint8)
    zero[3, 0] = 15
    scale0 = torch.arange(1, n + 1, dtype=torch.float16)
    from qoqtool.quantizers.formats import ProgressiveWeight

    packed = PackedLayout("progressive", n, k, 32).pack(ProgressiveWeight(codes, scale0, scale1, zero, 32, k))
    q = packed["qweight"]
    assert q.shape == (1, 2, 32, 16)
    # (3, 0): g 3, i 0, t 0, j 0 -> lane 12, byte 0 low; (3, 16): same byte, high nibble.
    assert int(q[0, 0, 12, 0]) == 0xC9
    # (5, 39) is column 7 of k-tile 1: h 0, t 1, j 3 -> lane 21, byte 3. Padding columns
    # 40..63 (k-tile 1, col 8..31) hold the zero point 1 in every real row.
    assert int(q[0, 1, 21, 3]) == 0x12
    assert int(q[0, 1, 0, 0]) == 0x10  # row 0: col 32 is real (code 0), col 48 is padding (1)
    assert packed["scale0"].tolist() == list(range(1, 9)) + [1.0] * 24  # padded rows: scale 1
    # zero x scale1, group 0: row 3 -> 15 * 8 = 120 at byte 4*3 + 0 = 12; other rows 0.
    zs1 = packed["zero_x_scale1"]
    assert int(zs1[0, 0, 12]) == 120 and int(zs1[0, 0].sum()) == 120
    # group 1: real rows r < 8 (i = 0, g = r) at byte 4r hold 1 * 2; padded rows hold 0.
    assert [int(v) for v in zs1[0, 1]] == [2 if b % 4 == 0 else 0 for b in range(32)]
    assert [int(v) for v in packed["scale1"][0, 1]] == [2 if b % 4 == 0 else 1 for b in range(32)]


# ------------------------------------------------------------------------------------------
# The lane's registers are its mma.m16n8k32 A fragments, as the PTX ISA defines them for
# .s8/.u8 A (registers a0..a3, four 8-bit elements each, element e = 4 * register + byte):
#   row = groupID      for e in 0..3 and 8..11,   groupID + 8 otherwise
#   col = 4 * threadID_in_group + (e & 3)  for e < 8,   + 16 for e >= 8

def _ptx_a_fragment(lane: int, e: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    row = g if (e < 4 or 8 <= e < 12) else g + 8
    col = 4 * t + (e & 3) + (16 if e >= 8 else 0)
    return row, col


def _words(lane_bytes: torch.Tensor) -> list[int]:
    """A lane's bytes as little-endian 32-bit words, as a 128-bit load leaves them."""
    b = [int(v) & 0xFF for v in lane_bytes]
    return [b[4 * w] | b[4 * w + 1] << 8 | b[4 * w + 2] << 16 | b[4 * w + 3] << 24 for w in range(len(b) // 4)]


def test_w4_lane_words_unpack_to_mma_fragments():
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (32, 32), dtype=torch.uint8)
    packed = layout.pack_w4(codes)
    for lane in range(32):
        w = _words(packed[0, 0, lane])
        lo = [x & 0x0F0F0F0F for x in w]  # two masks and a shift: no per-nibble work
        hi = [(x >> 4) & 0x0F0F0F0F for x in w]
        for block in range(2):
            regs = [lo[2 * block], lo[2 * block + 1], hi[2 * block], hi[2 * block + 1]]
            for e in range(16):
                row, col = _ptx_a_fragment(lane, e)
                value = (regs[e // 4] >> (8 * (e % 4))) & 0xFF
                assert value == int(codes[16 * block + row, col]), (lane, block, e)


def test_w8_lane_words_are_mma_fragments():
    torch.manual_seed(2)
    codes = torch.randint(-128, 128, (32, 32), dtype=torch.int8)
    packed = layout.pack_w8(codes)
    for lane in range(32):
        w = _words(packed[0, 0, lane])
        for block in range(2):
            regs = [w[4 * block], w[4 * block + 2], w[4 * block + 1], w[4 * block + 3]]
            for e in range(16):
                row, col = _ptx_a_fragment(lane, e)
                value = (regs[e // 4] >> (8 * (e % 4))) & 0xFF
                assert value == int(codes[16 * block + row, col]) & 0xFF, (lane, block, e)


def test_lane_fragment_coords_matches_pack():
    torch.manual_seed(3)
    codes = torch.randint(0, 16, (32, 32), dtype=torch.uint8)
    packed = layout.pack_w4(codes)
    for lane in range(32):
        for word in range(4):
            for byte in range(4):
                for nibble in range(2):
                    r, c = layout.lane_fragment_coords(lane, word, byte, nibble)
                    stored = (int(packed[0, 0, lane, 4 * word + byte]) >> (4 * nibble)) & 0xF
                    assert stored == int(codes[r, c])


# ------------------------------------------------------------------------------------------
# Round trips.

@pytest.mark.parametrize("shape", [(32, 32), (64, 96), (96, 160), (160, 64)])
def test_byte_orders_round_trip(shape):
    torch.manual_seed(shape[0] + shape[1])
    c4 = torch.randint(0, 16, shape, dtype=torch.uint8)
    c8 = torch.randint(-128, 128, shape, dtype=torch.int8)
    p = torch.randint(0, 256, (shape[0], 3), dtype=torch.uint8)
    assert torch.equal(layout.unpack_w4(layout.pack_w4(c4)), c4)
    assert torch.equal(layout.unpack_w8(layout.pack_w8(c8)), c8)
    assert torch.equal(layout.unpack_group_params(layout.pack_group_params(p)), p)


CONFIGS = [
    WeightQuantConfig(4, 128, "progressive"),
    WeightQuantConfig(4, 32, "progressive"),
    WeightQuantConfig(4, None, "asymmetric"),
    WeightQuantConfig(4, 64, "asymmetric"),
    WeightQuantConfig(8, None, "symmetric"),
]
SHAPES = [(40, 72), (96, 576), (33, 130)]  # N and K off the tile, K off the group


def _quantized(cfg, n, k, seed=0):
    torch.manual_seed(seed)
    return WeightScheme(cfg).quantize(torch.randn(n, k) * 0.05)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.describe())
def test_format_round_trip_is_bit_exact(cfg, shape):
    w = _quantized(cfg, *shape)
    lay = PackedLayout.of(w)
    packed = lay.pack(w)
    lay.check(packed)
    back = lay.unpack(packed)
    assert type(back) is type(w) and back.meta() == w.meta()
    assert back.tensors().keys() == w.tensors().keys()
    for name, t in w.tensors().items():
        assert back.tensors()[name].dtype == t.dtype and torch.equal(back.tensors()[name], t), name
    assert PackedLayout.from_meta(lay.meta()) == lay


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.describe())
def test_padding_is_neutral(cfg):
    n, k = 40, 72
    w = _quantized(cfg, n, k)
    lay = PackedLayout.of(w)
    packed = lay.pack(w)
    assert lay.n_padded == 64 and lay.k_padded == layout.padded_to(k, cfg.group_size or 32)
    if cfg.bits == 8:
        full = layout.unpack_w8(packed["qweight"])
        assert not full[n:].any() and not full[:, k:].any()
        assert torch.equal(packed["scale"][n:], torch.ones(lay.n_padded - n, dtype=torch.float16))
        return
    full = layout.unpack_w4(packed["qweight"])
    assert not full[n:].any()  # padded rows: code 0 = their zero point 0
    if lay.kind == "progressive":
        assert (layout.unpack_group_params(packed["scale1"])[n:] == 1).all()
        assert not layout.unpack_group_params(packed["zero_x_scale1"])[n:].any()
        s1 = layout.unpack_group_params(packed["scale1"]).long().repeat_interleave(cfg.group_size, 1)
        zs1 = layout.unpack_group_params(packed["zero_x_scale1"]).long().repeat_interleave(cfg.group_size, 1)
        level0 = full.long() * s1 - zs1  # what the kernel's multiply and byte subtract give
        assert not level0[:, k:].any() and not level0[n:].any()
        assert level0.min() >= -128 and level0.max() <= 127
    elif lay.group_size is None:
        assert torch.equal(full[:n, k:], w.zero.expand(n, lay.k_padded - k))  # each row's zero point
        assert not packed["zero"][n:].any()
    else:
        assert not layout.unpack_group_params(packed["zero"])[n:].any()


@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.describe())
def test_packed_linear_computes_exactly_the_reference(cfg, act_bits):
    n, k = 72, 200
    w = _quantized(cfg, n, k, seed=5)
    bias = torch.randn(n)
    x = torch.randn(2, 9, k) * 2
    ref = QuantLinear(w, bias, act_bits)(x)
    packed = PackedLinear.pack(w, bias, act_bits)
    assert torch.equal(packed(x), ref)
    assert (packed.in_features, packed.out_features, packed.n_padded) == (k, n, 96)


def test_packed_linear_state_and_dtype_protection():
    w = _quantized(WeightQuantConfig(4, 64, "progressive"), 64, 128)
    m = PackedLinear.pack(w, torch.randn(64), 8)
    assert set(m.state_dict()) == {"qweight", "scale0", "scale1", "zero_x_scale1", "bias"}
    m.reference()
    m.double()  # a model-wide cast must leave the packed parameters alone
    assert m.scale0.dtype == torch.float16 and m.qweight.dtype == torch.uint8
    assert m.bias.dtype == torch.float64
    assert "_reference" not in m.__dict__  # the unpacked cache is rebuilt after _apply
    assert torch.equal(m.unpacked().scale0, w.scale0)


def test_empty_then_load_state_dict():
    w = _quantized(WeightQuantConfig(4, None, "asymmetric"), 40, 96)
    src = PackedLinear.pack(w, None, 8)
    dst = PackedLinear.empty(src.layout, 8, None)
    dst.load_state_dict(src.state_dict(), assign=True)
    x = torch.randn(5, 96)
    assert torch.equal(dst(x), src(x))


def test_bad_input():
    with pytest.raises(ValueError, match="0..15"):
        layout.pack_w4(torch.full((32, 32), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="tile"):
        layout.pack_w4(torch.zeros(32, 48, dtype=torch.uint8))
    with pytest.raises(ValueError, match="int8"):
        layout.pack_w8(torch.zeros(32, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedLayout("uint4", 64, 96, 48)
    with pytest.raises(ValueError, match="per group"):
        PackedLayout("progressive", 64, 96, None)
    with pytest.raises(ValueError, match="unknown"):
        PackedLayout("nf4", 64, 96, 64)
    lay = PackedLayout("progressive", 32, 64, 32)
    good = lay.pack(_quantized(WeightQuantConfig(4, 32, "progressive"), 32, 64))
    with pytest.raises(ValueError, match="missing packed tensor 'scale1'"):
        lay.check({k: v for k, v in good.items() if k != "scale1"})
    with pytest.raises(ValueError, match="expected float16"):
        lay.check({**good, "scale0": good["scale0"].float()})
    bad = dict(good, zero_x_scale1=good["zero_x_scale1"] | 1, scale1=torch.full_like(good["scale1"], 2))
    with pytest.raises(ValueError, match="not a multiple of scale1"):
        lay.unpack(bad)
    # What the kernels assume of the group parameters is checked wherever packed tensors come in
    # (check: PackedLinear's loader, unpack): z * s1 <= 128, 1 <= s1 <= 16.
    s1 = torch.full_like(good["scale1"], 2)
    for bad, words in [(dict(good, scale1=s1, zero_x_scale1=torch.full_like(s1, 130)), "reaches 130, above the kernels' 128"),
                       (dict(good, scale1=torch.full_like(s1, 17), zero_x_scale1=torch.zeros_like(s1)), "outside the kernels' 1..16"),
                       (dict(good, scale1=torch.zeros_like(s1)), "outside the kernels' 1..16")]:
        with pytest.raises(ValueError, match=words):
            lay.check(bad)
    lay.check(dict(good, scale1=s1, zero_x_scale1=torch.full_like(s1, 128)))  # the bound itself is fine
    with pytest.raises(ValueError, match="does not fit"):
        PackedLayout("progressive", 32, 64, 64).pack(_quantized(WeightQuantConfig(4, 32, "progressive"), 32, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.describe())
def test_packed_linear_on_cuda_matches_reference(cfg):
    """Kernels where they exist (1e-3 relative: fp16 output), the reference path otherwise."""
    w = _quantized(cfg, 256, 576, seed=7)
    m = PackedLinear.pack(w, None, 8)
    # The kernels quantize activations from fp16 (cuda_ops.packed_linear_forward): give both
    # paths fp16 values, or the reference's codes differ (2.8e-3 relative from fp32 inputs).
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(3)).half().float()
    ref = m(x)
    out = m.to("cuda")(x.cuda()).cpu()
    assert out.dtype == ref.dtype
    assert (out - ref).norm() / ref.norm() < 1e-3
