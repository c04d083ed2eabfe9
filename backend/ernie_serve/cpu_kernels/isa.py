"""The instruction-set tiers the C kernels have code paths for, which of them this CPU runs, and the cap
ERNIE_CPU_ISA (and ERNIE_CPU_AMX=0) puts on them.

The paths are chosen at compile time (the sources' #if branches on the compiler's target macros, -march=native), so
a tier below the CPU's own is a library compiled with the higher tiers' instruction sets switched off (build.py
builds and caches one per tier asked for). AMX alone is also a run-time switch (cpu_amx.c's ernie_set_amx): the
tier below it shares the CPU's own library with AMX off, as ERNIE_CPU_AMX=0 always did.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

# Lowest first. Each tier: the /proc/cpuinfo flags it needs (with every lower tier's), and per flag of the CPU's the
# compiler switch that takes it away when the cap is below the tier (only flags the CPU has are switched off: the
# native target has no others, and an older compiler may not know their switches).
_TIERS: dict[str, tuple[tuple[str, ...], tuple[tuple[str, str], ...]]] = {
    "scalar": ((), ()),  # the plain C loops every kernel keeps (and the only tier off x86)
    "avx2": (("avx2", "fma"), (("avx2", "-mno-avx2"), ("fma", "-mno-fma"))),  # vec16.h's AVX2 halves, AVX2 int blocks
    "avx512": (("avx512f",), (("avx512f", "-mno-avx512f"),)),  # vec16.h's __m512; int8 / int4 still the AVX2 blocks
    # cpu_qgemm.c's vpdpbusd blocks; AVX-VNNI (VEX) goes with it so the tiers below hold no dot-product instruction
    "avx512_vnni": (("avx512bw", "avx512_vnni"), (("avx512_vnni", "-mno-avx512vnni"), ("avx_vnni", "-mno-avxvnni"))),
    "amx": (("amx_tile", "amx_bf16"), (("amx_tile", "-mno-amx-tile"), ("amx_bf16", "-mno-amx-bf16"),
                                       ("amx_int8", "-mno-amx-int8"))),  # cpu_amx.c: bfloat16 and int8 tiles
}
ISAS: tuple[str, ...] = tuple(_TIERS)


def cpu_isas(flags: set[str]) -> list[str]:
    """The tiers a CPU with these /proc/cpuinfo flags runs, lowest first: each needs its flags and every lower
    tier's ("scalar" always)."""
    have = []
    for name, (needs, _) in _TIERS.items():
        if not set(needs) <= flags:
            break
        have.append(name)
    return have


def cap_from_env(env: Mapping[str, str], cpu: Sequence[str]) -> str:
    """The highest tier the kernels may use: ERNIE_CPU_ISA (default: the CPU's highest, `cpu[-1]`), below AMX with
    ERNIE_CPU_AMX=0. An unknown name, a tier the CPU lacks, or amx with ERNIE_CPU_AMX=0 is refused (ValueError
    naming the variable), never quietly lowered."""
    amx = env.get("ERNIE_CPU_AMX", "1")
    if amx not in ("0", "1"):
        raise ValueError(f"ERNIE_CPU_AMX={amx!r}: expected 1 (bfloat16 and int8 GEMMs on AMX where the CPU has it, "
                         "default) or 0 (never)")
    asked = env.get("ERNIE_CPU_ISA", "")
    if not asked:
        return cpu[-2] if amx == "0" and cpu[-1] == "amx" else cpu[-1]
    if asked not in _TIERS:
        raise ValueError(f"ERNIE_CPU_ISA={asked!r}: expected one of {', '.join(ISAS)} (unset: the CPU's highest)")
    if asked == "amx" and amx == "0":
        raise ValueError("ERNIE_CPU_ISA=amx with ERNIE_CPU_AMX=0: the two disagree; unset one of them")
    if asked not in cpu:
        raise ValueError(f"ERNIE_CPU_ISA={asked}: this CPU runs only {', '.join(cpu)} (its flags lack "
                         f"{', '.join(_TIERS[asked][0])} or a lower tier's)")
    return asked


def compile_flags(isa: str, cpu: Sequence[str], flags: set[str]) -> tuple[str, ...]:
    """The switches after -march=native that build the library for tier `isa` on a CPU running the tiers `cpu`
    with these flags: none for the CPU's highest tier, nor for the one below AMX (it shares that library, AMX off)."""
    top = len(cpu) - 1
    at = ISAS.index(isa)
    if at >= top - (cpu[-1] == "amx"):
        return ()
    return tuple(switch for tier in ISAS[at + 1:top + 1] for flag, switch in _TIERS[tier][1] if flag in flags)
