"""calibrl.kernels: pinned float kernels make an AVX-512 CPU train what an AVX2 CPU trains.

The machine test trains a tiny Llama in fresh processes (each library reads its kernel
variables once, at its first kernel) and compares the weights bit for bit: with the pin,
this CPU's run equals a run restricted to AVX2 (``ATEN_CPU_CAPABILITY=avx2``,
``MKL_ENABLE_INSTRUCTIONS=AVX2``: what an AVX2-only CPU computes); without it, on a CPU
with AVX-512, the two differ (the control: the bug the pin fixes shows here).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from calibrl import kernels

ROOT = pathlib.Path(__file__).resolve().parent.parent
HAS_AVX2 = kernels.cpu_has_avx2()
HAS_AVX512 = HAS_AVX2 and "avx512f" in pathlib.Path("/proc/cpuinfo").read_text()
# MKL takes MKL_CBWR=AVX2 on Intel CPUs only; elsewhere it reports AUTO and runs one code path.
MKL_PINNED_PATH = "AVX2" if kernels.cpu_vendor() == "GenuineIntel" else "AUTO"
AVX2_ONLY_CPU = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

# Trains a 2-layer Llama (hidden 64) for 30 AdamW steps on seeded random tokens, one thread,
# and prints a digest of its weights and the kernels it ran.
TRAIN = """
import sys
from calibrl import kernels
result = kernels.pin(native=sys.argv[1] == "native")
import hashlib, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.set_num_threads(1)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
tokens = torch.randint(0, 256, (30, 8, 32), generator=torch.Generator().manual_seed(1))
for batch in tokens:
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(digest[:16], "|", kernels.describe(), "|", result.reason)
"""


def _train(mode: str, extra_env: dict[str, str]) -> tuple[str, str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (kernels.NATIVE_SWITCH, *kernels.PINNED,
                                                              "MKL_ENABLE_INSTRUCTIONS")}
    env.update(extra_env)
    proc = subprocess.run([sys.executable, "-c", TRAIN, mode], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    digest, described, reason = (part.strip() for part in proc.stdout.strip().splitlines()[-1].split("|"))
    return digest, described, reason


def test_pin_sets_what_is_unset_and_keeps_what_the_user_set() -> None:
    env: dict[str, str] = {}
    assert kernels.pin(env, has_avx2=True) == kernels.PinResult(True, "pinned to AVX2")
    assert env == kernels.PINNED

    env = {"ATEN_CPU_CAPABILITY": "default"}  # make test-numerics
    result = kernels.pin(env, has_avx2=True)
    assert not result.pinned and "ATEN_CPU_CAPABILITY=default" in result.reason
    assert env["ATEN_CPU_CAPABILITY"] == "default" and env["MKL_CBWR"] == "AVX2"


def test_native_switch_and_cpus_without_avx2_leave_the_kernels_alone() -> None:
    env: dict[str, str] = {}
    result = kernels.pin(env, native=True, has_avx2=True)
    assert not result.pinned and "asked for" in result.reason
    assert env == {kernels.NATIVE_SWITCH: "native"}  # the processes a run starts stay native too
    assert not kernels.pin(env, has_avx2=True).pinned and set(env) == {kernels.NATIVE_SWITCH}

    env = {}
    result = kernels.pin(env, has_avx2=False)
    assert not result.pinned and "not x86-64 with AVX2" in result.reason and env == {}


def test_cpu_vendor_is_read_from_cpuinfo(tmp_path: pathlib.Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nvendor_id\t: AuthenticAMD\nflags : avx2\n")
    assert kernels.cpu_vendor(info) == "AuthenticAMD"
    assert kernels.cpu_vendor(tmp_path / "missing") == ""


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: pathlib.Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu sse2 avx avx2 fma\n")
    assert kernels.cpu_has_avx2(info) == (os.uname().machine in ("x86_64", "AMD64"))
    info.write_text("processor : 0\nflags : fpu sse2 avx\n")
    assert not kernels.cpu_has_avx2(info)
    assert not kernels.cpu_has_avx2(tmp_path / "missing")


@pytest.mark.skipif(not HAS_AVX2, reason="pinning applies to x86-64 CPUs with AVX2")
def test_pinned_training_equals_an_avx2_only_cpu() -> None:
    pinned, described, reason = _train("pin", {})
    assert reason == "pinned to AVX2"
    assert described == f"ATen AVX2, MKL code path {MKL_PINNED_PATH}, oneDNN max ISA AVX2"
    avx2_cpu, described_avx2, _ = _train("native", AVX2_ONLY_CPU)
    assert described_avx2.startswith("ATen AVX2, MKL code path native")
    assert pinned == avx2_cpu  # bit for bit: the same weights as a CPU that has nothing beyond AVX2


@pytest.mark.skipif(not HAS_AVX512, reason="the control needs a CPU with AVX-512")
def test_without_the_pin_an_avx512_cpu_trains_other_weights() -> None:
    native, described, reason = _train("native", {})
    assert described.startswith("ATen AVX512") and "asked for" in reason
    avx2_cpu, _, _ = _train("native", AVX2_ONLY_CPU)
    assert native != avx2_cpu  # what the pin fixes: the CPU changes the trained weights
