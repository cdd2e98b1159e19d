"""Counter-based random numbers: SplitMix64 and stateless uniform draws keyed by integers.

A draw is a pure function of its key (e.g. (seed, index)), not a step of a generator object, so
there is no RNG state to snapshot or restore: a resumed run, a replayed request and every shard of
a split step recompute exactly the draws one uninterrupted process would make, and the same
arithmetic in numpy uint64 gives the same bits on any device.
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
"""SplitMix64's state increment (2**64 / golden ratio, odd)."""


def mix64(z: int) -> int:
    """SplitMix64's output finalizer (Stafford's Mix13): a bijection of 64-bit words that scatters
    every input bit over the output, so consecutive keys give unrelated words."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def splitmix64(x: int) -> int:
    """The SplitMix64 output of state `x` (advance by the golden gamma, then mix): the standard
    generator's first output when seeded with `x`, usable as a 64-bit hash of an integer."""
    return mix64(x + GOLDEN_GAMMA)


def unit_float(bits: int) -> float:
    """The top 53 bits of a 64-bit word as a float in [0, 1), every value exactly representable."""
    return (bits >> 11) * 2.0**-53


def uniform(seed: int, index: int) -> float:
    """Uniform in [0, 1) for draw `index` of the stream keyed `seed`, recomputable from the pair.

    `u = unit_float(splitmix64(splitmix64(seed) ^ index))` with both keys taken modulo 2**64, so
    numpy uint64 arithmetic reproduces it bit for bit.
    """
    return unit_float(splitmix64(splitmix64(seed & MASK64) ^ (index & MASK64)))
