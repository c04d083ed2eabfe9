"""The `isa` fixture: a kernel test that takes it runs once per instruction-set tier this CPU has (build.isas():
on an AMX Xeon scalar, avx2, avx512, avx512_vnni and amx), each on the library built for that tier, so a path the
CPU can run is run, not only compiled; the test ids name the tier. A test limited to some tiers parametrizes `isa`
itself (indirect=True) over those of build.isas() it needs (none: pytest skips it, saying the set is empty)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from ernie_serve.cpu_kernels import build


@pytest.fixture(params=build.isas())
def isa(request) -> Iterator[str]:
    if not build.available():
        pytest.skip("no C compiler to build the CPU kernels")
    build.use_isa(request.param)
    try:
        yield request.param
    finally:
        build.use_isa(build.isas()[-1])  # the process's own tier again, for the tests that do not take `isa`
