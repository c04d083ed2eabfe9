"""The `isa` fixture: a kernel test that takes it runs once per instruction-set tier this CPU has (build.isas():
on an AMX Xeon scalar, avx2, avx512, avx512_vnni and amx), each on the library built for that tier, so a path the
CPU can run is run, not only compiled; the test ids name the tier. A test limited to some tiers parametrizes `isa`
itself (indirect=True) over those it needs; a tier this process does not run is skipped with the refusal
ERNIE_CPU_ISA=<tier> gets, which names the CPU flag it lacks.

At the session's end a report says, per tier, how many kernel tests ran and how they ended, or why the tier did not
run; with ERNIE_ISA_REPORT=<path> it is also written there as JSON (benchmarks/results/cpu_isa_paths_*.json quote
it)."""
from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from ernie_serve.cpu_kernels import build
from ernie_serve.cpu_kernels.isa import ISAS, cap_from_env

_OUTCOMES: defaultdict[str, Counter] = defaultdict(Counter)  # tier -> passed / failed / skipped -> tests


def not_run_because(tier: str) -> str | None:
    """Why this process does not run `tier`, None when it does: the refusal ERNIE_CPU_ISA=<tier> gets (naming the
    flags the CPU lacks), or the cap that ERNIE_CPU_ISA / ERNIE_CPU_AMX set below it."""
    if tier in build.isas():
        return None
    try:
        cap_from_env({"ERNIE_CPU_ISA": tier}, build.cpu_isas())
    except ValueError as e:
        return str(e)
    return f"{tier}: above this process's cap, {build.isas()[-1]} (ERNIE_CPU_ISA / ERNIE_CPU_AMX)"


@pytest.fixture(params=build.isas())
def isa(request) -> Iterator[str]:
    why = not_run_because(request.param)
    if why:
        pytest.skip(why)
    if not build.available():
        pytest.skip("no C compiler to build the CPU kernels")
    build.use_isa(request.param)
    try:
        yield request.param
    finally:
        build.use_isa(build.isas()[-1])  # the process's own tier again, for the tests that do not take `isa`


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Counts each test that took a tier by its outcome: its call's, or its setup's where that skipped or failed."""
    outcome = yield
    report = outcome.get_result()
    tier = getattr(item, "callspec", None) and item.callspec.params.get("isa")
    if tier and (report.when == "call" or (report.when == "setup" and not report.passed)):
        _OUTCOMES[tier][report.outcome] += 1


def tier_report() -> dict[str, dict]:
    """Per tier (lowest first): the kernel tests that ran on it by outcome, and why it did not run (None: it did)."""
    return {tier: {"not_run_because": not_run_because(tier), **{k: _OUTCOMES[tier][k] for k in
                                                                 ("passed", "failed", "skipped")}} for tier in ISAS}


def pytest_terminal_summary(terminalreporter) -> None:
    if not _OUTCOMES:
        return  # no test that takes a tier ran in this session
    report = tier_report()
    terminalreporter.write_sep("-", "CPU kernel tiers (ERNIE_CPU_ISA)")
    for tier, r in report.items():
        if r["not_run_because"] is None:
            terminalreporter.write_line(f"{tier}: ran: {r['passed']} passed, {r['failed']} failed, "
                                        f"{r['skipped']} skipped")
        else:
            terminalreporter.write_line(f"{tier}: not run: {r['not_run_because']}")
    path = os.environ.get("ERNIE_ISA_REPORT")
    if path:
        Path(path).write_text(json.dumps({"cpu_tiers": build.cpu_isas(), "tiers": report}, indent=2) + "\n")
