"""Hadamard matrices of the sizes LLM hidden dimensions come in.

A Hadamard matrix H (entries +-1, H H^T = n I) exists only for n = 1, 2 or a multiple of
4. Sylvester's construction gives the powers of two; Paley's give q + 1 for a prime
q = 3 (mod 4) and 2(q + 1) for a prime q = 1 (mod 4); Kronecker products of Hadamard
matrices are Hadamard. So we write n = 2^a * m with m a Paley order (or a product of
two) - e.g. 576 = 16 * 36 (Paley II, q = 17), 3584 = 128 * 28 (Paley II, q = 13),
5120 = 256 * 20 (Paley I, q = 19), 12288 = 1024 * 12. Sizes that have no such
decomposition get a clear error naming the size.

`random_hadamard(n, seed)` is H diag(+-1) / sqrt(n): orthogonal, and the random signs keep
the rotation from lining up with structure in the weights (QuaRot).
"""

from __future__ import annotations

import functools

import torch

from qoqtool.errors import UserError


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    i = 2
    while i * i <= q:
        if q % i == 0:
            return False
        i += 1
    return True


def paley_character(q: int) -> torch.Tensor:
    """chi[a] = legendre(a mod q) for prime q (float64: 0, then +-1): the Jacobsthal matrix is
    the circulant Q[i, j] = chi[(j - i) mod q], so x Q is a circular convolution of x with chi
    (qoqtool.runtime.mlp applies large Paley factors that way, by FFT)."""
    residues = {(x * x) % q for x in range(1, q)}
    return torch.tensor([0] + [1 if a in residues else -1 for a in range(1, q)], dtype=torch.float64)


def _jacobsthal(q: int) -> torch.Tensor:
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return paley_character(q)[idx]


def _paley1(q: int) -> torch.Tensor:
    """Order q + 1 for prime q = 3 mod 4: H = I + S, S skew-symmetric conference matrix."""
    n = q + 1
    s = torch.zeros(n, n, dtype=torch.float64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = _jacobsthal(q)
    return torch.eye(n, dtype=torch.float64) + s


def _paley2(q: int) -> torch.Tensor:
    """Order 2(q + 1) for prime q = 1 mod 4, from the symmetric conference matrix C."""
    n = q + 1
    c = torch.zeros(n, n, dtype=torch.float64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = _jacobsthal(q)
    a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, a) + torch.kron(torch.eye(n, dtype=torch.float64), b)


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _paley_orders(limit: int) -> dict[int, tuple[str, int]]:
    """Every Paley order up to `limit`: order -> (construction, q)."""
    orders: dict[int, tuple[str, int]] = {1: ("one", 0), 2: ("sylvester", 2)}
    for q in range(3, limit):
        if not _is_prime(q):
            continue
        if q % 4 == 3 and q + 1 <= limit:
            orders.setdefault(q + 1, ("paley1", q))
        if q % 4 == 1 and 2 * (q + 1) <= limit:
            orders.setdefault(2 * (q + 1), ("paley2", q))
    return orders


def build_factor(order: int, kind: str, q: int) -> torch.Tensor:
    """The Hadamard factor of one `constructions` entry (float64, +-1)."""
    if kind == "one":
        return torch.ones(1, 1, dtype=torch.float64)
    if kind == "sylvester":
        return _sylvester(order)
    return _paley1(q) if kind == "paley1" else _paley2(q)


def decompose(n: int) -> list[int] | None:
    """Factors [2^a, m1(, m2)] of n whose Hadamard matrices we can build, or None."""
    if n < 1:
        return None
    a = (n & -n)  # largest power of two dividing n
    odd_part = n // a
    orders = _paley_orders(n)
    # Spend as few factors of two as possible on the Paley part, keep the rest Sylvester.
    for two in [2**i for i in range(a.bit_length())]:
        m = odd_part * two
        if m in orders:
            return [n // m, m]
    for m1 in sorted(orders):
        if m1 > 2 and n % m1 == 0:
            rest = n // m1
            rest_two = rest & -rest
            for two in [2**i for i in range(rest_two.bit_length())]:
                m2 = (rest // rest_two) * two
                if m2 in orders and m2 > 2:
                    return [rest // m2, m1, m2]
    return None


def constructions(n: int) -> list[tuple[int, str, int]]:
    """(order, construction, q) of each factor of `hadamard(n)` in Kronecker order - Sylvester's
    2^a first ("sylvester" or "one", q = 0), then the Paley orders ("paley1" / "paley2" and
    their prime q) - or a UserError naming n."""
    parts = decompose(n)
    if parts is None:
        raise UserError(
            f"no Hadamard matrix of order {n} can be built (it must be 2^a times a Paley order, "
            f"e.g. 12, 20, 28, 36, 44, 60); disable the rotate step for this model"
        )
    orders = _paley_orders(n)
    first = ("sylvester" if parts[0] > 1 else "one", 0)
    return [(parts[0], *first)] + [(m, *orders[m]) for m in parts[1:]]


def factors(n: int) -> list[torch.Tensor]:
    """Hadamard matrices (float64, +-1) whose Kronecker product is `hadamard(n)`, or a
    UserError naming n: Sylvester's 2^a first, then the Paley orders."""
    return [build_factor(*c) for c in constructions(n)]


@functools.lru_cache(maxsize=32)
def hadamard(n: int) -> torch.Tensor:
    """A Hadamard matrix of order n (float64, entries +-1), or a UserError naming n."""
    h = functools.reduce(torch.kron, factors(n))
    # A cheap probe of H H^T = n I (the full product costs seconds at n = 4096).
    v = torch.randn(n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    if not torch.allclose(h @ (h.t() @ v), n * v, rtol=1e-9, atol=1e-6):
        raise AssertionError(f"construction of H_{n} failed")  # a bug, not user input
    return h


def random_signs(n: int, seed: int = 0) -> torch.Tensor:
    """The seeded +-1 column signs of random_hadamard(n, seed) (float64)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1


def random_hadamard(n: int, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    """An orthogonal n x n matrix H diag(s) / sqrt(n) with random signs s (seeded)."""
    return (hadamard(n) * random_signs(n, seed)[None, :] / n**0.5).to(dtype)
