"""bf16 weights on the CPU at every ATen kernel level: a policy's forward and a judge's scores.

torch 2.13's CPU flash-attention kernel takes an AMX code path for bf16 on processors
with AMX and fails ("pack_vnni2 is only supported when avx512 is supported") when ATen's
kernels are held below AVX-512, as ``calibrl demo`` pins them and ``make test-numerics``
sets them. ``load_policy`` gives a half-precision CPU model eager attention and the
transformers judge runs its forwards with SDPA's math kernel. Each level runs in its own
process: ATen reads ``ATEN_CPU_CAPABILITY`` once.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")

CHECK = r"""
import json, sys
import torch
torch.set_num_threads(1)
from calibrl.judge_server.config import JudgeConfig
from calibrl.judge_server.judge import load_llm
from calibrl.judge_server.rubric import Criterion
from calibrl.api.judge import JudgeItem
from calibrl.testing.logprobs import sequence_logprobs
from calibrl.trainer.policy import load_policy

folder, amx = sys.argv[1], sys.argv[2] == "1"
result = {"capability": torch.backends.cpu.get_cpu_capability()}
ids = None
for dtype in ("float32", "bfloat16"):
    policy = load_policy(folder, device="cpu", dtype=dtype).model.eval()
    if ids is None:
        ids = torch.randint(0, policy.config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
    with torch.no_grad():
        result[f"policy_{dtype}"] = sequence_logprobs(policy, ids, mask).float().tolist()
criteria = [Criterion("intent", "llm", 1.0, question="Does the output keep the intent of the user's query?")]
query = " ".join(["what is the expense ratio of the evergreen growth fund"] * 12)  # a prompt of > 64 tokens
items = [JudgeItem.make(query, "evergreen growth fund expense ratio"), JudgeItem.make("q", "short")]
for dtype in ("float32", "bfloat16"):
    judge = load_llm(JudgeConfig(backend=f"transformers:{folder}", device="cpu", dtype=dtype))
    result[f"judge_{dtype}"] = judge.score(items, criteria, "")
    result["prompt_tokens"] = len(judge.encoder.encode(items[:1], criteria, "").prefix_ids[0])
if amx and result["capability"] in ("DEFAULT", "AVX2"):
    # the failure the fix avoids: plain SDPA on bf16 at this kernel level
    q = torch.randn(1, 4, 200, 16, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        result["plain_sdpa"] = "ran"
    except RuntimeError as exc:
        result["plain_sdpa"] = str(exc)
print(json.dumps(result))
"""


def _has_amx() -> bool:
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    return cpuinfo.exists() and "amx_bf16" in cpuinfo.read_text()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from calibrl.testing import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("bf16"), arch="llama", seed=3)


@pytest.mark.parametrize("capability", ["default", "avx2", "native"])
def test_bf16_weights_on_cpu_run_at_every_kernel_level(capability, tiny_model):
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability != "native":
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run([sys.executable, "-c", CHECK, str(tiny_model), "1" if _has_amx() else "0"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if capability != "native":
        assert result["capability"] == capability.upper()
    assert result["prompt_tokens"] > 64  # long enough for the flash kernel's blocked path
    # bf16 rounds to 8 significant bits (unit roundoff u = 2^-9). A token's log-probability passes
    # through about 25 roundings on its way through 2 layers (projections, attention, MLP, norms,
    # head, log-softmax), so to first order it moves by at most about 25u of its magnitude, twice
    # that between two paths: 2 * 25u * |log p|. A wrong mask or kernel moves them by nats.
    fp32, bf16 = result["policy_float32"], result["policy_bfloat16"]
    pairs = [(a, b) for ra, rb in zip(fp32, bf16) for a, b in zip(ra, rb)]
    assert all(b <= 0.0 for _, b in pairs)
    assert all(abs(a - b) <= 2 * 25 * 2**-9 * max(abs(a), 1.0) for a, b in pairs)
    for a, b in zip(result["judge_float32"], result["judge_bfloat16"]):
        assert len(b) == len(a) == 1 and 0.0 <= b[0] <= 1.0
    if "plain_sdpa" in result:  # an AMX CPU below AVX-512: this test guards a real failure
        assert "pack_vnni2" in result["plain_sdpa"]
