"""The C kernels as kvserve.kernels builds them for ARM64 (CC and KVSERVE_MARCH naming Debian's cross compiler,
gcc-aarch64-linux-gnu, and the target; run under qemu-user, where Python and torch do not run) and for this machine:
tests/kernels/csrc/check_kernels.c, linked with each library, checks its GEMM (NEON's tiles in the ARM64 one), KV
codecs, paged attention and argmax against references in double; the ARM64 library exports every kernel the engine
calls."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvserve import kernels
from kvserve.model import layers

HARNESS = Path(__file__).resolve().parent / "csrc" / "check_kernels.c"
CROSS_CC, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu"
ARM64_MARCH = "armv8.2-a"       # Graviton 2, Apple M1 and later, and every ARM64 server core since
# checks the harness runs, by kernel: gemm.c's only in a build that multiplies both dtypes
GEMM_CHECKS = {"gemm": 48, "gemm_rows": 24}
OTHER_CHECKS = {"store_token": 5, "paged_decode": 7, "paged_prefill": 3, "argmax_rows": 2}

cross = pytest.mark.skipif(shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None,
                           reason=f"no {CROSS_CC} or {QEMU} (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)")


@dataclass
class Report:
    """What a run of the harness printed: each check's name and whether it passed, csrc/gemm.c's report of its
    kernels and dtypes (bits), the hash of the codecs' bytes, and the summary's counts."""

    checks: dict[str, bool]
    kernels: int
    dtypes: int
    codecs: str
    count: int
    failed: int

    def by_kernel(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for name in self.checks:
            counts[name.split()[0]] = counts.get(name.split()[0], 0) + 1
        return counts

    def names(self) -> set[str]:
        """The checks' names less the GEMM kernel's (the same checks in every build)."""
        return {re.sub(r"^gemm \w+ ", "gemm ", name) for name in self.checks}


def build(cc: str, march: str, library: Path, out: Path) -> Path:
    """The harness compiled for the target of the kernels' library (its macros, GEMM_SIMD among them, are the
    library's) and linked with it."""
    subprocess.run([cc, "-O2", f"-march={march}", "-fopenmp", f"-I{kernels.CSRC}", str(HARNESS), str(library), "-lm",
                    "-o", str(out)], check=True, capture_output=True, timeout=300)
    return out


def run(command: list[str]) -> Report:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "2"})
    lines = result.stdout.splitlines()
    fails = [line for line in lines if line.startswith("FAIL")]
    assert result.returncode == (1 if fails else 0), result.stdout[-2000:] + result.stderr[-2000:]
    assert not fails, "\n".join(fails)
    summary = re.fullmatch(r"checks: (\d+) failed: (\d+)", lines[-1])
    gemm = re.fullmatch(r"gemm kernels (\d+) dtypes (\d+)", lines[-3])
    codecs = re.fullmatch(r"codecs ([0-9a-f]{16})", lines[-2])
    assert summary and gemm and codecs, result.stdout[-2000:]
    checks = {line[3:]: True for line in lines if line.startswith("ok ")}
    return Report(checks, int(gemm[1]), int(gemm[2]), codecs[1], int(summary[1]), int(summary[2]))


def expected_checks(report: Report) -> dict[str, int]:
    return {**(GEMM_CHECKS if report.dtypes == 0b11 else {}), **OTHER_CHECKS}


@pytest.fixture(scope="module")
def arm64_library(tmp_path_factory) -> Path:
    """kvserve.kernels' build of the kernels with CC and KVSERVE_MARCH naming the ARM64 target."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("CC", CROSS_CC)
        m.setenv(kernels.MARCH_ENV, ARM64_MARCH)
        m.setenv("KVSERVE_CACHE", str(tmp_path_factory.mktemp("aarch64")))
        return kernels.build()


@pytest.fixture(scope="module")
def arm64(arm64_library) -> Report:
    exe = build(CROSS_CC, ARM64_MARCH, arm64_library, arm64_library.parent / "check_kernels")
    return run([QEMU, "-L", SYSROOT, str(exe)])


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> Report:
    if kernels.library() is None:
        pytest.skip("the kernels cannot be built here")
    cc = os.environ.get("CC", "cc")
    return run([str(build(cc, kernels.march(), kernels.build(), tmp_path_factory.mktemp("native") / "check_kernels"))])


@cross
def test_the_arm64_build_passes_every_check_by_neons_tiles(arm64):
    """Every check passes under qemu-aarch64, all of them ran (GEMM's among them: both dtypes by NEON's tiles, the
    only vector kernel the ARM64 build reports)."""
    assert arm64.kernels == 1 << layers.GEMM_KERNELS.index("neon")
    assert arm64.dtypes == 0b11
    assert arm64.by_kernel() == expected_checks(arm64)
    assert arm64.count == sum(expected_checks(arm64).values()) and arm64.failed == 0
    assert all(name.startswith("gemm neon ") for name in arm64.checks if name.startswith("gemm "))


def test_the_native_build_passes_every_check(native):
    """The same harness with the engine's own library (the suite's target, kvserve.kernels.march)."""
    assert native.by_kernel() == expected_checks(native)
    assert native.count == sum(expected_checks(native).values()) and native.failed == 0
    lib = kernels.library()
    assert native.kernels == kernels.typed(lib, "gemm_kernels")()
    assert native.dtypes == kernels.typed(lib, "gemm_dtypes")()


@cross
def test_both_builds_run_the_same_checks_and_codecs_write_the_same_bytes(arm64, native):
    """The codecs compute without fused multiply-adds, each op as torch's: every byte they write is the same on both
    targets."""
    if native.dtypes == 0b11:
        assert arm64.names() == native.names()
    assert arm64.codecs == native.codecs


@cross
def test_the_arm64_library_exports_every_kernel_with_neon_code(arm64_library):
    """The ARM64 library compiles (no x86 intrinsic reaches it), exports every kernel SIGNATURES declares, and its GEMM
    multiplies by NEON's vector FMA."""
    nm = shutil.which("aarch64-linux-gnu-nm") or pytest.skip("no aarch64-linux-gnu-nm (binutils-aarch64-linux-gnu)")
    symbols = subprocess.run([nm, "-D", "--defined-only", str(arm64_library)], capture_output=True, text=True,
                             check=True).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
    assert set(kernels.SIGNATURES) <= exported
    code = subprocess.run([nm.replace("-nm", "-objdump"), "-d", str(arm64_library)], capture_output=True, text=True,
                          check=True).stdout
    assert re.search(r"\bfmla\s+v\d+\.4s", code)
