"""`@slow_opt_in(cost)`: a test too slow for the default run on CI's two cores. It is marked `slow` and runs only
under DSV4_SLOW_TESTS=1 (README, "Tests"); `cost` says what it compiles and how long it takes, for the skip reason."""

import os

import pytest


def slow_opt_in(cost: str):
    skip = pytest.mark.skipif(not os.environ.get("DSV4_SLOW_TESTS"), reason=f"{cost}: set DSV4_SLOW_TESTS=1")
    return lambda test: pytest.mark.slow(skip(test))
