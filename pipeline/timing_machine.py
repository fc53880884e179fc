"""The machine a measurement ran on, recorded beside its times (benchmark summaries, the flagship
rehearsal, the embedded target's build report): the CPU's model, its cores, and whether it
computes bfloat16 natively, as the kernel reports it (/proc/cpuinfo flags) and as torch sees it.

In the library, not in harness/, for the one user the package ships: `python -m pipeline.toy.build`
records the machine in the kit's build.json beside the build's times, and the package never imports
harness/ (not installed; tests/command_line/test_layers.py). The benchmarks take it from here too.

Why bf16 in particular: a CPU run in bf16 is an order of magnitude slower on a CPU without bf16
instructions, which emulates them (the rehearsal test: 17 minutes with avx512_bf16, 82 without),
so a wall time without the machine's bf16 support cannot be compared with another. Anything that
cannot be read is None ("unknown"), never a guess. Costs one read of /proc/cpuinfo.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# The x86 flags of native bf16 arithmetic: AVX-512 BF16 (dot products and conversions) and AMX
# BF16 (tile matrix multiplies); oneDNN uses either when present.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def read_cpuinfo(path: Path = CPUINFO) -> tuple[str | None, set[str] | None]:
    """(the first processor's model name, its flags), each None where the file or the line is absent
    (not Linux, an ARM kernel that names neither)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None, None
    model = flags = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip() or None
        elif key in ("flags", "Features") and flags is None:   # x86 / ARM spelling
            flags = set(value.split())
        if model is not None and flags is not None:
            break
    return model, flags


def torch_cpu_view() -> dict:
    """What torch itself reports about this CPU: the vector ISA its kernels dispatch to and its
    own bf16 / AMX probes (private functions, so None where a version lacks them)."""
    import torch

    def probe(name: str):
        fn = getattr(torch.cpu, name, None)
        try:
            return bool(fn()) if fn is not None else None
        except (RuntimeError, AttributeError):
            return None

    return {"capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": probe("_is_avx512_bf16_supported"), "amx_tile": probe("_is_amx_tile_supported")}


def describe_machine(*, with_torch: bool = True) -> dict:
    """{cpu, cpus, bf16: {avx512_bf16, amx_bf16: bool or None}, and with torch: torch (its
    version), torch_threads, torch_cpu: {capability, avx512_bf16, amx_tile}, gpu (None: none)}:
    the one record of the machine for every summary of times."""
    model, flags = read_cpuinfo()
    out = {"cpu": model or platform.processor() or platform.machine() or None,
           "cpus": os.cpu_count(),
           "bf16": {flag: (flag in flags) if flags is not None else None for flag in BF16_FLAGS}}
    if with_torch:
        import torch

        out.update(torch=torch.__version__, torch_threads=torch.get_num_threads(), torch_cpu=torch_cpu_view(),
                   gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    return out


def machine_line(machine: dict) -> str:
    """One line for a table's header: 'AMD EPYC, 2 cores, bf16: avx512_bf16 (torch: AVX512)'."""
    native = [flag for flag, present in machine["bf16"].items() if present]
    unknown = all(present is None for present in machine["bf16"].values())
    bf16 = "unknown" if unknown else (", ".join(native) if native else "none (emulated: slow)")
    seen = (machine.get("torch_cpu") or {}).get("capability")
    return (f"{machine['cpu'] or 'unknown CPU'}, {machine['cpus']} cores, bf16: {bf16}"
            + (f" (torch: {seen})" if seen else "") + (f", GPU {machine['gpu']}" if isinstance(machine.get("gpu"), str) and machine["gpu"] else ""))
