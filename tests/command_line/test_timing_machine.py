"""The machine beside benchmark times (issue 57, item 5; pipeline/timing_machine.py): the CPU's
model and its bf16 flags as /proc/cpuinfo has them, read here independently (a regular expression
over the whole file, every processor's flags), and the parser on hand-written files of both
spellings."""

from __future__ import annotations

import os
import re
from pathlib import Path


from pipeline.timing_machine import BF16_FLAGS, describe_machine, machine_line, read_cpuinfo
from harness.prerequisites import needs

CPUINFO = Path("/proc/cpuinfo")


@needs(CPUINFO.is_file(), "no /proc/cpuinfo on this system")
def test_the_machine_is_what_proc_cpuinfo_says():
    text = CPUINFO.read_text(errors="replace")
    models = re.findall(r"^model name\s*:\s*(.*?)\s*$", text, re.MULTILINE)
    flag_lines = [set(line.split()) for line in re.findall(r"^(?:flags|Features)\s*:(.*)$", text, re.MULTILINE)]
    machine = describe_machine()
    if models:
        assert machine["cpu"] == models[0]
    assert machine["cpus"] == os.cpu_count()
    for flag in BF16_FLAGS:
        # every core of one machine has the same flags: the first processor speaks for all
        want = None if not flag_lines else all(flag in flags for flags in flag_lines)
        assert machine["bf16"][flag] == want, flag
    assert machine["torch_cpu"]["capability"] in ("DEFAULT", "VSX", "ZVECTOR", "AVX2", "AVX512", "SVE256", "SVE")
    assert machine["torch_cpu"]["avx512_bf16"] in (True, False, None)


def test_the_parser_reads_x86_and_arm_files_and_says_unknown_for_the_rest(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu sse avx512f avx512_bf16 "
                   "amx_bf16 amx_tile\n\nprocessor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu\n")
    assert read_cpuinfo(x86) == ("Intel(R) Xeon(R) Platinum 8480+", {"fpu", "sse", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd bf16 sve\nCPU implementer\t: 0x41\n")
    assert read_cpuinfo(arm) == (None, {"fp", "asimd", "bf16", "sve"})
    assert read_cpuinfo(tmp_path / "absent") == (None, None)


def test_the_line_says_native_emulated_or_unknown():
    base = {"cpu": "AMD EPYC", "cpus": 2, "torch_cpu": {"capability": "AVX512"}, "gpu": None}
    assert machine_line({**base, "bf16": {"avx512_bf16": True, "amx_bf16": False}}) == \
        "AMD EPYC, 2 cores, bf16: avx512_bf16 (torch: AVX512)"
    assert machine_line({**base, "bf16": {"avx512_bf16": False, "amx_bf16": False}}) == \
        "AMD EPYC, 2 cores, bf16: none (emulated: slow) (torch: AVX512)"
    assert machine_line({**base, "cpu": None, "bf16": {"avx512_bf16": None, "amx_bf16": None}, "gpu": "NVIDIA H200"}) == \
        "unknown CPU, 2 cores, bf16: unknown (torch: AVX512), GPU NVIDIA H200"
