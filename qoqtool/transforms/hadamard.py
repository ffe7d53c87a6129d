"""Hadamard matrices of the sizes LLM hidden dimensions come in.

A Hadamard matrix H (entries +-1, H H^T = n I) exists only for n = 1, 2 or a multiple of
4. Sylvester's construction gives the powers of two; Paley's give q + 1 for a prime power
q = 3 (mod 4) and 2(q + 1) for a prime power q = 1 (mod 4); Kronecker products of
Hadamard matrices are Hadamard. So we write n = 2^a * m with m a Paley order (or a product
of two) - e.g. 576 = 16 * 36 (Paley II, q = 17), 3584 = 128 * 28 (Paley II, q = 13),
5120 = 256 * 20 (Paley I, q = 19), 12288 = 1024 * 12. Sizes that have no such
decomposition get a clear error naming the size.

Two versions of the constructions (the rotate step's `hadamard` parameter), because an
online rotation is rebuilt at load time and must be the matrix the weights were rotated
with:
  1  Paley over prime fields only (q prime). Llama-2's intermediate size 11008 = 2^8 * 43
     is then 2 * 5504 (q = 5503): a 5504-order factor, applied by FFT (qoqtool.runtime.mlp).
  2  also over prime-power fields GF(p^k), k >= 2, for the orders primes do not give:
     11008 = 32 * 344 (Paley I over GF(7^3)). Every order that a prime gives keeps its prime
     construction, so the two versions differ only for sizes that version 1 builds from a
     larger factor or cannot build at all.
A recipe without the key runs version 2 (RotateParams); a saved recipe without it was made
with version 1 (SAVED_DEFAULT), before version 2 existed.

`random_hadamard(n, seed)` is H diag(+-1) / sqrt(n): orthogonal, and the random signs keep
the rotation from lining up with structure in the weights (QuaRot).
"""

from __future__ import annotations

import functools

import torch

from qoqtool.errors import UserError

VERSIONS = (1, 2)  # the constructions' versions (module docstring)
SAVED_DEFAULT = 1  # the version of a saved recipe whose rotate step does not name one


def is_prime(q: int) -> bool:
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


def _prime_power(q: int) -> tuple[int, int] | None:
    """(p, k) with q = p^k, p prime, or None."""
    for p in range(2, q + 1):
        if q % p == 0:
            k = 0
            while q % p == 0:
                q //= p
                k += 1
            return (p, k) if q == 1 else None
    return None


def _poly_mod(a: list[int], f: list[int], p: int) -> list[int]:
    """a mod f over GF(p); coefficient lists, lowest degree first, f monic."""
    a = a[:]
    for i in range(len(a) - 1, len(f) - 2, -1):
        c = a[i]
        if c:
            for j, fj in enumerate(f):
                a[i - len(f) + 1 + j] = (a[i - len(f) + 1 + j] - c * fj) % p
    return a[: len(f) - 1]


def _irreducible(p: int, k: int) -> list[int]:
    """The first monic irreducible polynomial of degree k over GF(p) (coefficients c_0..c_k,
    lowest first; candidates in the order of sum c_i p^i). Fixed once and for all: the field's
    elements are numbered by it, so it is part of what a version-2 rotation is."""
    def monic(d: int, code: int) -> list[int]:
        return [code // p**i % p for i in range(d)] + [1]

    for code in range(p**k):
        f = monic(k, code)
        if all(any(_poly_mod(f, monic(d, c), p)) for d in range(1, k // 2 + 1) for c in range(p**d)):
            return f
    raise AssertionError(f"no irreducible polynomial of degree {k} over GF({p})")  # none is missing


def _field_character(q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GF(q), q = p^k: the elements numbered 0..q-1 by their coefficients (element e is
    sum_i digit_i(e) x^i in GF(p)[x] / f, digits base p), as (digits [q, k], chi [q]) with chi
    the quadratic character (0 at 0, +1 on the nonzero squares, -1 elsewhere)."""
    p, k = _prime_power(q)
    f = _irreducible(p, k)
    digits = [[e // p**i % p for i in range(k)] for e in range(q)]
    squares = set()
    for d in digits[1:]:
        prod = [0] * (2 * k - 1)
        for i, a in enumerate(d):
            for j, b in enumerate(d):
                prod[i + j] += a * b
        squares.add(sum(c * p**i for i, c in enumerate(_poly_mod([c % p for c in prod], f, p))))
    chi = torch.tensor([0] + [1 if e in squares else -1 for e in range(1, q)], dtype=torch.float64)
    return torch.tensor(digits, dtype=torch.long), chi


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = chi(e_j - e_i) over GF(q): for a prime q the circulant of paley_character."""
    if is_prime(q):
        idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
        return paley_character(q)[idx]
    p, _ = _prime_power(q)
    digits, chi = _field_character(q)
    diff = (digits[None, :, :] - digits[:, None, :]) % p  # e_j - e_i, digit by digit
    return chi[(diff * p ** torch.arange(digits.shape[1])).sum(-1)]


def _paley1(q: int) -> torch.Tensor:
    """Order q + 1 for a prime power q = 3 mod 4: H = I + S, S skew-symmetric conference matrix."""
    n = q + 1
    s = torch.zeros(n, n, dtype=torch.float64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = _jacobsthal(q)
    return torch.eye(n, dtype=torch.float64) + s


def _paley2(q: int) -> torch.Tensor:
    """Order 2(q + 1) for a prime power q = 1 mod 4, from the symmetric conference matrix C."""
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


@functools.lru_cache(maxsize=64)  # (every layer's rotation asks again; callers only read it)
def _paley_orders(limit: int, version: int) -> dict[int, tuple[str, int]]:
    """Every Paley order up to `limit`: order -> (construction, q). Primes first, so that an
    order a prime gives keeps that construction in version 2 (prime powers only add orders)."""
    orders: dict[int, tuple[str, int]] = {1: ("one", 0), 2: ("sylvester", 2)}
    fields = [q for q in range(3, limit) if is_prime(q)]
    if version >= 2:
        fields += [q for q in range(3, limit) if not is_prime(q) and _prime_power(q)]
    for q in fields:
        if q % 4 == 3 and q + 1 <= limit:
            orders.setdefault(q + 1, ("paley1", q))
        if q % 4 == 1 and 2 * (q + 1) <= limit:
            orders.setdefault(2 * (q + 1), ("paley2", q))
    return orders


def check_version(version: int) -> None:
    if version not in VERSIONS:
        raise UserError(f"rotate: hadamard must be one of {', '.join(map(str, VERSIONS))}, not {version!r}")


def build_factor(order: int, kind: str, q: int) -> torch.Tensor:
    """The Hadamard factor of one `constructions` entry (float64, +-1)."""
    if kind == "one":
        return torch.ones(1, 1, dtype=torch.float64)
    if kind == "sylvester":
        return _sylvester(order)
    return _paley1(q) if kind == "paley1" else _paley2(q)


def decompose(n: int, version: int = 2) -> list[int] | None:
    """Factors [2^a, m1(, m2)] of n whose Hadamard matrices we can build, or None."""
    check_version(version)
    if n < 1:
        return None
    a = (n & -n)  # largest power of two dividing n
    odd_part = n // a
    orders = _paley_orders(n, version)
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


def constructions(n: int, version: int = 2) -> list[tuple[int, str, int]]:
    """(order, construction, q) of each factor of `hadamard(n, version)` in Kronecker order -
    Sylvester's 2^a first ("sylvester" or "one", q = 0), then the Paley orders ("paley1" /
    "paley2" and their prime or prime-power q) - or a UserError naming n."""
    parts = decompose(n, version)
    if parts is None:
        raise UserError(
            f"no Hadamard matrix of order {n} can be built (it must be 2^a times a Paley order, "
            f"e.g. 12, 20, 28, 36, 44, 60); disable the rotate step for this model"
        )
    orders = _paley_orders(n, version)
    first = ("sylvester" if parts[0] > 1 else "one", 0)
    return [(parts[0], *first)] + [(m, *orders[m]) for m in parts[1:]]


def factors(n: int, version: int = 2) -> list[torch.Tensor]:
    """Hadamard matrices (float64, +-1) whose Kronecker product is `hadamard(n, version)`, or a
    UserError naming n: Sylvester's 2^a first, then the Paley orders."""
    return [build_factor(*c) for c in constructions(n, version)]


@functools.lru_cache(maxsize=32)
def hadamard(n: int, version: int = 2) -> torch.Tensor:
    """A Hadamard matrix of order n (float64, entries +-1), or a UserError naming n."""
    h = functools.reduce(torch.kron, factors(n, version))
    # A cheap probe of H H^T = n I (the full product costs seconds at n = 4096).
    v = torch.randn(n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    if not torch.allclose(h @ (h.t() @ v), n * v, rtol=1e-9, atol=1e-6):
        raise AssertionError(f"construction of H_{n} failed")  # a bug, not user input
    return h


def random_signs(n: int, seed: int = 0) -> torch.Tensor:
    """The seeded +-1 column signs of random_hadamard(n, seed) (float64)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1


def random_hadamard(n: int, seed: int = 0, dtype=torch.float64, version: int = 2) -> torch.Tensor:
    """An orthogonal n x n matrix H diag(s) / sqrt(n) with random signs s (seeded)."""
    return (hadamard(n, version) * random_signs(n, seed)[None, :] / n**0.5).to(dtype)
