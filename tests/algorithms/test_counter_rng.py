"""Counter-based RNG: SplitMix64 against the reference generator's published outputs, and the
stateless uniform draw ported to numpy uint64."""

import numpy as np

from rlvr.algorithms.counter_rng import GOLDEN_GAMMA, MASK64, splitmix64, uniform, unit_float


def reference_stream(seed: int, n: int) -> list[int]:
    """The first n outputs of the SplitMix64 generator seeded with `seed` (state += gamma)."""
    return [splitmix64((seed + k * GOLDEN_GAMMA) & MASK64) for k in range(n)]


def test_splitmix64_matches_the_reference_generator():
    # Vigna's splitmix64.c seeded with 0, and the Rosetta Code task's seed 1234567.
    assert reference_stream(0, 4) == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
        0xF88BB8A8724C81EC,
    ]
    assert reference_stream(1234567, 5) == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]


def test_unit_float_keeps_the_top_53_bits():
    assert unit_float(0) == 0.0
    assert unit_float(MASK64) == 1.0 - 2.0**-53
    assert unit_float(1 << 63) == 0.5


def test_uniform_is_keyed_and_ports_to_numpy_uint64():
    assert uniform(0, 0) == unit_float(splitmix64(0xE220A8397B1DCDAF))
    assert uniform(-1, 3) == uniform(MASK64, 3)

    def np_mix(x: np.ndarray) -> np.ndarray:
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

    seed, index = np.uint64(123456789), np.arange(50, dtype=np.uint64)
    with np.errstate(over="ignore"):
        u = (np_mix(np_mix(seed) ^ index) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    np.testing.assert_array_equal(u, [uniform(123456789, i) for i in range(50)])
    assert all(0.0 <= x < 1.0 for x in u)
