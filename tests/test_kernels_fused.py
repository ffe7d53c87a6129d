"""The fused quantization kernels against qoqtool.quantizers.activations.quantize_per_token.

quantize_per_token is bit-exact (same amax, same IEEE division by the same fp16 scale,
same round-half-to-even). rmsnorm_quantize and silu_mul_quantize compute their fp16 input
as transformers does, up to the order of a sum and the rsqrt/exp approximations, so their
codes may differ by one where a value sits on a rounding boundary: the tests bound how
often and by how much. GPU tests are marked gpu; the validation tests run on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from qoqtool.quantizers.activations import quantize_per_token as reference_quantize
from qoqtool.runtime import cuda_ops

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernels run there)")

SHAPES = [  # M, K, K padded
    (1, 576, 576),
    (3, 576, 640),  # padded to the g128 group
    (7, 100, 128),  # K not a multiple of 8: the scalar-load path
    (33, 4096, 4096),
    (5, 11008, 11008),
    (2, 28672, 28672),
    (300, 1536, 1536),
]


def random_rows(m, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda") * torch.rand(m, 1, generator=g, device="cuda") * 8
    x[0, : k // 3] *= 50  # an outlier channel band, as real activations have
    return x.half()


def check_against_reference(got, y: torch.Tensor, k_padded: int, exact: bool) -> None:
    """got = (x_q, x_scale, x_rowsum) from a kernel; y the fp16 values it quantized."""
    x_q, x_scale, x_rowsum = got
    m, k = y.shape
    assert x_q.shape == (m, k_padded) and x_scale.shape == (m,) and x_rowsum.shape == (m,)
    assert torch.equal(x_q[:, k:], torch.zeros_like(x_q[:, k:])), "the padding must be zero"
    assert torch.equal(x_rowsum, x_q.sum(1, dtype=torch.int32)), "row sums of the codes"
    codes, scales = reference_quantize(y)
    if exact:
        assert torch.equal(x_q[:, :k], codes)
        assert torch.equal(x_scale.float(), scales)
        return
    # One fp16 ulp of the scale, one code step, on a small fraction of the values.
    assert ((x_scale.float() - scales).abs() <= scales * 2**-10).all()
    diff = (x_q[:, :k].int() - codes.int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 2e-3


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,k,kp", SHAPES)
def test_quantize_per_token_is_bit_exact(m, k, kp):
    x = random_rows(m, k)
    x[-1] = 0  # an all-zero row: the scale is the smallest fp16, the codes 0
    check_against_reference(torch.ops.qoqtool.quantize_per_token(x, kp), x, kp, exact=True)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,k,kp", SHAPES)
def test_rmsnorm_quantize_matches_llama_rmsnorm(m, k, kp):
    x = random_rows(m, k)
    weight = (torch.rand(k, device="cuda") + 0.5).half()
    eps = 1e-5
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).half()  # LlamaRMSNorm in fp16
    check_against_reference(torch.ops.qoqtool.rmsnorm_quantize(x, weight, eps, kp), y, kp, exact=False)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,k,kp", SHAPES)
def test_add_rmsnorm_quantize_is_the_add_then_rmsnorm_quantize(m, k, kp):
    """The residual add in the norm's kernel: its sum is torch's fp16 add and its codes, scales
    and sums are rmsnorm_quantize's of that sum, bit for bit."""
    x, delta = random_rows(m, k), random_rows(m, k, seed=3)
    weight = (torch.rand(k, device="cuda") + 0.5).half()
    total, *quantized = torch.ops.qoqtool.add_rmsnorm_quantize(x, delta, weight, 1e-5, kp)
    assert torch.equal(total, x + delta)
    for got, want in zip(quantized, torch.ops.qoqtool.rmsnorm_quantize(x + delta, weight, 1e-5, kp)):
        assert torch.equal(got, want)
    assert torch.equal(x, random_rows(m, k)), "x is read, not written"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,k,kp", SHAPES)
def test_fp16_rmsnorm_matches_llama_rmsnorm_and_adds_the_residual(m, k, kp):
    """rmsnorm / add_rmsnorm (the norms of fp16 models): transformers' LlamaRMSNorm up to the
    order of the sum of squares (an fp16 ulp on a few values); add_rmsnorm's sum is torch's add
    and its norm is rmsnorm's of that sum, bit for bit."""
    x, delta = random_rows(m, k), random_rows(m, k, seed=3)
    weight = (torch.rand(k, device="cuda") + 0.5).half()
    xf = x.float()
    want = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).half()
    got = torch.ops.qoqtool.rmsnorm(x, weight, 1e-5)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-5)
    assert (got != want).float().mean() < 0.02
    total, normed = torch.ops.qoqtool.add_rmsnorm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, torch.ops.qoqtool.rmsnorm(x + delta, weight, 1e-5))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,k,kp", SHAPES)
def test_silu_mul_quantize_matches_fp32_product(m, k, kp):
    gate, up = random_rows(m, k, 1), random_rows(m, k, 2)
    y = (torch.nn.functional.silu(gate.float()) * up.float()).half()
    check_against_reference(torch.ops.qoqtool.silu_mul_quantize(gate, up, kp), y, kp, exact=False)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,k,kp", [(1, 14336, 14336), (5, 1536, 1536), (64, 14336, 14336), (3, 512, 512),
                                    (2, 28672, 28672), (7, 1536, 1664), (1, 12288, 12288), (16, 12288, 12288)])
def test_silu_mul_rotate_quantize_matches_the_unfused_rotation(m, k, kp):
    """The down_proj rotation of the default recipe (runtime.mlp.KroneckerRotation: Sylvester
    x a Paley factor, e.g. 14336 = 512 x 28, 1536 = 128 x 12, Qwen3-8B's 12288 = 1024 x 12 and
    Llama-3-70B's 28672 = 1024 x 28 with two rows of X per thread; 512 has no second factor) fused
    with the SiLU product and the quantization: the codes of the unfused rotation, to rounding."""
    from qoqtool.runtime.mlp import KroneckerRotation

    gate, up = random_rows(m, k, 1), random_rows(m, k, 2)
    rotation = KroneckerRotation(k, seed=7).cuda()
    a, factor = rotation.fused_form()
    product = (torch.nn.functional.silu(gate.float()) * up.float()).half()
    y = rotation(product)  # fp32 inside, back to fp16: what down_proj's quantization sees unfused
    got = torch.ops.qoqtool.silu_mul_rotate_quantize(gate, up, factor.contiguous(), rotation.signs, a, kp)
    check_against_reference(got, y, kp, exact=False)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("a,order,kp", [(32, 3, 128), (64, 5, 384), (1024, 7, 7168), (128, 30, 3840), (32, 32, 1024)])
def test_silu_mul_rotate_quantize_takes_any_factor_order(a, order, kp):
    """Factors of any order up to 32, not only the Hadamard orders KroneckerRotation builds (1 and
    multiples of 4): odd orders write their codes byte by byte, rows of X start anywhere in a
    word. The reference is the op's definition, vec(H_a^T X F) diag(s) / sqrt(a) in fp32."""
    from qoqtool.transforms.hadamard import build_factor

    k, m = a * order, 3
    gate, up = random_rows(m, k, 1), random_rows(m, k, 2)
    g = torch.Generator(device="cuda").manual_seed(order)
    factor = torch.linalg.qr(torch.randn(order, order, generator=g, device="cuda"))[0].contiguous()
    signs = torch.where(torch.rand(k, generator=g, device="cuda") < 0.5, -1.0, 1.0)
    product = (torch.nn.functional.silu(gate.float()) * up.float()).half().float()
    h = build_factor(a, "sylvester", 2).to("cuda", torch.float32)
    y = ((h.t() @ product.reshape(m, a, order) @ factor).reshape(m, k) * signs / a**0.5).half()
    got = torch.ops.qoqtool.silu_mul_rotate_quantize(gate, up, factor, signs, a, kp)
    check_against_reference(got, y, kp, exact=False)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,k,kp", [(1, 11008, 11008), (16, 11008, 11008), (64, 11008, 11008), (3, 18944, 18944),
                                    (5, 4864, 4864), (2, 27648, 27648), (7, 5632, 5632), (4, 8960, 9088),
                                    (1, 14336, 14336), (9, 1536, 1664)])
def test_silu_mul_rotate_quantize_bits_matches_the_unfused_rotation(m, k, kp):
    """The tensor-core form, F = H / sqrt(m) with H's sign bits: Llama-2's 11008 = 32 x 344,
    Qwen2.5's 18944 = 128 x 148, 4864 = 64 x 76, 27648 = 256 x 108, 8960 = 64 x 140 (K padded),
    TinyLlama's 5632 = 128 x 44, and the small factors the CUDA-core form also takes (Llama-3's
    512 x 28, the demo's 128 x 12) - the codes of the unfused rotation, to rounding; and
    runtime.fusion picks this op above BITS_ABOVE."""
    from qoqtool.runtime import fusion
    from qoqtool.runtime.mlp import KroneckerRotation

    gate, up = random_rows(m, k, 1), random_rows(m, k, 2)
    rotation = KroneckerRotation(k, seed=7).cuda()
    a, factor = rotation.fused_form()
    product = (torch.nn.functional.silu(gate.float()) * up.float()).half()
    y = rotation(product)
    got = torch.ops.qoqtool.silu_mul_rotate_quantize_bits(gate, up, rotation.factor_bits, rotation.signs, a, kp)
    check_against_reference(got, y, kp, exact=False)
    op, sylvester, operand = fusion._fused_rotation(rotation)
    bits = factor.shape[0] > fusion.BITS_ABOVE
    assert sylvester == a and op is getattr(torch.ops.qoqtool, "silu_mul_rotate_quantize" + ("_bits" if bits else ""))
    assert operand is (rotation.factor_bits if bits else factor)


@gpu
@pytest.mark.gpu
def test_quantize_under_cuda_graph():
    x = random_rows(16, 4096)
    op = torch.ops.qoqtool.quantize_per_token
    op(x, 4096)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = op(x, 4096)
    x.copy_(random_rows(16, 4096, seed=5))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(static, op(x, 4096)):
        assert torch.equal(a, b)


def test_rotation_validation_rejects_bad_forms_on_the_cpu():
    gate = torch.zeros(2, 384, dtype=torch.float16)
    signs = torch.ones(384)
    cases = [
        ((torch.ones(12, 12), signs, 64), "got K = 384, a = 64, m = 12"),  # 64 x 12 is not 384
        ((torch.ones(12, 12), signs, 32), None),  # a valid form: refused only for being on the CPU
        ((torch.ones(48, 48), signs, 8), "got K = 384, a = 8, m = 48"),  # m > 32, a < 32
        ((torch.ones(8, 8), signs, 48), "got K = 384, a = 48, m = 8"),  # a not a power of two
        ((torch.ones(1, 1), torch.ones(2048), 2048), None),  # K = 2048 (the gate is 384 wide): refused first
        ((torch.ones(12, 12).double(), signs, 32), "factor must be float32"),
        ((torch.ones(12, 12), torch.ones(95), 32), r"signs must have shape \[384\]"),
    ]
    for (factor, s, a), message in cases:
        with pytest.raises(ValueError, match=message or "CUDA|signs must have shape"):
            cuda_ops.silu_mul_rotate_quantize(gate, gate, factor, s, a, 384)
    wide = torch.zeros(1, 2048, dtype=torch.float16)  # 2048 = 2048 x 1: the Sylvester order is past 1024
    with pytest.raises(ValueError, match="a power of two from 32 to 1024"):
        cuda_ops.silu_mul_rotate_quantize(wide, wide, torch.ones(1, 1), torch.ones(2048), 2048, 2048)


def test_rotation_bits_validation_rejects_bad_forms_on_the_cpu():
    """The tensor-core form: m even, 2..512, K = a m, within the shared memory; int32 bits of
    shape [m, ceil(m / 32)]."""
    def bits(m):
        return cuda_ops.hadamard_sign_bits(torch.ones(m, m))

    cases = [  # (K, a, m, bits) -> message (None: valid, refused only for being on the CPU)
        (11008, 32, 344, bits(344), None),
        (32 * 28, 32, 28, bits(28), None),  # (runtime.fusion gives orders <= 32 to the fp32-factor op)
        (32 * 342, 64, 171, bits(171), "m even"),  # odd
        (32 * 516, 32, 516, bits(516), "to 512"),  # past the largest order
        (11008, 32, 344, bits(344)[:, :10], r"bits must have shape \[344, 11\]"),
        (11008, 32, 344, bits(344).long(), "bits must be int32"),
    ]
    for k, a, m, b, message in cases:
        gate = torch.zeros(1, k, dtype=torch.float16)
        with pytest.raises(ValueError, match=message or "CUDA"):
            cuda_ops.silu_mul_rotate_quantize_bits(gate, gate, b, torch.ones(k), a, k)


def test_hadamard_sign_bits_round_trip():
    """bit k % 32 of word [n, k // 32] is set exactly where H[k, n] < 0 (padding bits clear)."""
    from qoqtool.transforms.hadamard import build_factor

    for m, kind, q in [(344, "paley1", 343), (148, "paley2", 73), (44, "paley1", 43)]:
        h = build_factor(m, kind, q) / m**0.5
        words = cuda_ops.hadamard_sign_bits(h).long() & 0xFFFFFFFF
        unpacked = ((words[:, :, None] >> torch.arange(32)) & 1).reshape(m, -1)
        assert torch.equal(unpacked[:, :m].bool(), h.t() < 0) and not unpacked[:, m:].any()


def test_validation_rejects_bad_input_on_the_cpu():
    x = torch.zeros(4, 100, dtype=torch.float16)
    with pytest.raises(ValueError, match="float16"):
        cuda_ops.quantize_per_token(x.float(), 128)
    with pytest.raises(ValueError, match="k_padded"):
        cuda_ops.quantize_per_token(x, 112)  # not a multiple of 32
    with pytest.raises(ValueError, match="k_padded"):
        cuda_ops.quantize_per_token(x, 96)  # shorter than K
    with pytest.raises(ValueError, match="k_padded"):
        cuda_ops.quantize_per_token(torch.zeros(1, 40000, dtype=torch.float16), 40000)
    with pytest.raises(ValueError, match="contiguous"):
        cuda_ops.quantize_per_token(torch.zeros(128, 4, dtype=torch.float16).t(), 128)
    with pytest.raises(ValueError, match="weight must have shape"):
        cuda_ops.rmsnorm_quantize(x, torch.ones(99, dtype=torch.float16), 1e-5, 128)
    with pytest.raises(ValueError, match="up must have shape"):
        cuda_ops.silu_mul_quantize(x, x[:2], 128)
    with pytest.raises(ValueError, match=r"delta must have shape \[4, 100\]"):
        cuda_ops.add_rmsnorm_quantize(x, x[:, :50].contiguous(), torch.ones(100, dtype=torch.float16), 1e-5, 128)
    with pytest.raises(ValueError, match="delta must be float16"):
        cuda_ops.add_rmsnorm_quantize(x, x.float(), torch.ones(100, dtype=torch.float16), 1e-5, 128)
    with pytest.raises(ValueError, match="CUDA"):
        cuda_ops.add_rmsnorm_quantize(x, x, torch.ones(100, dtype=torch.float16), 1e-5, 128)
    with pytest.raises(ValueError, match=r"weight must have shape \[100\]"):
        cuda_ops.rmsnorm(x, torch.ones(64, dtype=torch.float16), 1e-5)
    with pytest.raises(ValueError, match=r"delta must have shape \[4, 100\]"):
        cuda_ops.add_rmsnorm(x, x[:2].contiguous(), torch.ones(100, dtype=torch.float16), 1e-5)
    with pytest.raises(ValueError, match="CUDA"):
        cuda_ops.add_rmsnorm(x, x, torch.ones(100, dtype=torch.float16), 1e-5)
    with pytest.raises(ValueError, match="CUDA"):
        cuda_ops.quantize_per_token(x, 128)
