"""Pinned CPU float kernels: the same trained numbers on every x86-64 CPU with AVX2.

torch picks its float kernels by CPU: ATen's vectorised kernels
(``ATEN_CPU_CAPABILITY``), MKL's BLAS code path (``MKL_CBWR``) and oneDNN's
instruction set (``ONEDNN_MAX_CPU_ISA``). Each choice rounds differently in the
last bits, and training amplifies those bits: the demo's LLM judge trained to
kappa 0.579 on an AVX-512 Intel CPU and to 0.773 on an AVX2 AMD one. Pinning the
three to AVX2 makes an AVX-512 CPU compute what an AVX2-only CPU computes.

MKL honours ``MKL_CBWR=AVX2`` on Intel CPUs only: elsewhere (AMD) it reports the
``AUTO`` branch and runs the same BLAS code whatever is asked of it (native, capped
with ``MKL_ENABLE_INSTRUCTIONS=AVX2`` or "pinned" give the same bits there), so a
report names the MKL code path it actually ran (:func:`describe`), and trained
figures are reproducible bit for bit among CPUs that report the same line.

Each library reads its variable once, when it first runs a kernel, so :func:`pin`
must run before torch is imported: ``calibrl demo`` and ``calibrl study`` call it
first thing, and every process they start (services, ``calibrl train``) inherits
the variables. A variable the user already set is kept (``make test-numerics``
sets ``ATEN_CPU_CAPABILITY=default``). ``CALIBRL_KERNELS=native`` (what
``--native-kernels`` sets, so the processes a run starts follow it) turns pinning off.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import platform
import sys
from dataclasses import dataclass
from typing import Any, ContextManager, MutableMapping

NATIVE_SWITCH = "CALIBRL_KERNELS"  # =native: leave the kernels to the CPU
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# mkl_cbwr.h: the value mkl_cbwr_get(MKL_CBWR_BRANCH) returns for each code path.
_MKL_BRANCH = {1: "native (CNR off)", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX",
               10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}
_MKL_CBWR_BRANCH = 1


@dataclass(frozen=True)
class PinResult:
    """What :func:`pin` did: ``pinned`` when every variable holds its pinned value."""

    pinned: bool
    reason: str


def cpu_has_avx2(cpuinfo: pathlib.Path = pathlib.Path("/proc/cpuinfo")) -> bool:
    """Whether this is an x86-64 CPU with AVX2 and FMA (read without importing torch)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    words = set(flags.split())
    return {"avx2", "fma"} <= words


def cpu_vendor(cpuinfo: pathlib.Path = pathlib.Path("/proc/cpuinfo")) -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``, ...), or "" where unknown."""
    try:
        line = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def pin(environ: MutableMapping[str, str] | None = None, *, native: bool = False,
        has_avx2: bool | None = None) -> PinResult:
    """Set the :data:`PINNED` variables that are unset (module doc); call before importing torch."""
    env = os.environ if environ is None else environ
    if native:
        env[NATIVE_SWITCH] = "native"
    if env.get(NATIVE_SWITCH) == "native":
        return PinResult(False, "native kernels (asked for): trained numbers depend on this CPU")
    if not (cpu_has_avx2() if has_avx2 is None else has_avx2):
        return PinResult(False, "native kernels: this CPU is not x86-64 with AVX2, so trained numbers may differ "
                                "from the published results (docs/results/demo.md)")
    if "torch" in sys.modules and environ is None:
        already = all(env.get(name) == value for name, value in PINNED.items())
        return PinResult(already, "pinned to AVX2" if already else
                         "native kernels: torch was loaded before the kernels could be pinned")
    kept = [f"{name}={env[name]}" for name, value in PINNED.items() if env.get(name, value) != value]
    for name, value in PINNED.items():
        env.setdefault(name, value)
    if kept:
        return PinResult(False, "pinned to AVX2 except what the environment set: " + ", ".join(kept))
    return PinResult(True, "pinned to AVX2")


def mkl_branch() -> str:
    """MKL's active code path (``AVX2`` when pinned), or ``unknown`` where torch has no MKL."""
    try:
        import torch

        library = ctypes.CDLL(str(pathlib.Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        getter = library.mkl_serv_cbwr_get
    except (ImportError, OSError, AttributeError):
        return "unknown"
    getter.restype = ctypes.c_int
    getter.argtypes = [ctypes.c_int]
    code = getter(_MKL_CBWR_BRANCH)
    return _MKL_BRANCH.get(code, f"code {code}")


def describe() -> str:
    """The kernels this process runs, for a report's machine line (imports torch)."""
    import torch

    aten = torch.backends.cpu.get_cpu_capability()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "native")
    return f"ATen {aten}, MKL code path {mkl_branch()}, oneDNN max ISA {onednn}"


def cpu_half_precision(device: Any, dtype: Any) -> bool:
    """Whether a model computes in bfloat16 or float16 on the CPU (``device``: a torch
    device or its name; imports torch)."""
    import torch

    return str(device).split(":")[0] == "cpu" and dtype in (torch.bfloat16, torch.float16)


def math_attention() -> ContextManager[None]:
    """``scaled_dot_product_attention`` on its math kernel inside the ``with`` (imports torch).

    torch 2.13's CPU flash-attention kernel takes an AMX code path for bf16 whenever the
    processor has AMX, and that path fails ("pack_vnni2 is only supported when avx512 is
    supported") when ATen's vector kernels are held below AVX-512, as :func:`pin` and
    ``ATEN_CPU_CAPABILITY=default`` hold them. The math kernel runs on every CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def half_precision_attention(device: Any, dtype: Any) -> ContextManager[None]:
    """:func:`math_attention` for a half-precision model on the CPU, else a no-op."""
    return math_attention() if cpu_half_precision(device, dtype) else contextlib.nullcontext()


__all__ = ["NATIVE_SWITCH", "PINNED", "PinResult", "cpu_half_precision", "cpu_has_avx2", "describe",
           "half_precision_attention", "math_attention", "mkl_branch", "pin"]
