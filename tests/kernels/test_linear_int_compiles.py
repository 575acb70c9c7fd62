"""The int8/int4 kernel compiled for the GPUs it targets, without one: Triton lowers it to PTX and the ptxas
that ships with triton assembles it for sm_89 (Ada) and sm_90 (Hopper). The interpreter (test_linear_int.py)
checks the arithmetic; this checks what only the compiler sees (layouts, tl.dot shapes, types) and that the
decode shapes fit in registers (no spills to local memory), for the next session that is lent a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

COMPILE = r"""
import json, os, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tidal.kernels.linear_int import BLOCK_N, _linear_int_kernel

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
names = ["x_ptr", "w_ptr", "scale_ptr", "zero_ptr", "bias_ptr", "out_ptr", "M", "N", "K", "n_padded", "k_tiles",
         "stride_xm", "stride_om", "group_size"]
results = []
for arch, act, bits, per_tile, zero, block_m in json.loads(sys.argv[1]):
    signature = dict(zip(names, [f"*{act}", "*i8" if bits == 8 else "*u8", "*fp32", "*fp32", f"*{act}", f"*{act}"]
                         + ["i32"] * 8))
    constants = dict(BITS=bits, HAS_ZERO=zero, HAS_BIAS=True, SCALE_PER_TILE=per_tile, DOT_IN_FP32=act == "fp32",
                     BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=128)
    signature.update({name: "constexpr" for name in constants})
    kernel = triton.compile(ASTSource(fn=_linear_int_kernel, signature=signature, constexprs=constants),
                            target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
    path = f"k{len(results)}.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    fields = dict(part.split(":") for line in usage.splitlines() if "REG:" in line for part in line.split())
    results.append({"regs": int(fields["REG"]), "stack": int(fields["STACK"])})
print(json.dumps(results))
"""

# (sm, activations, bits, scale per tile, zero points, rows per program): decode (16 rows) and prefill (32)
# in bf16/fp16 for int4 group 128 and int8 per channel, and the odd-group path
CASES = [
    (90, "bf16", 4, True, False, 16), (90, "bf16", 8, True, False, 16), (90, "bf16", 4, True, True, 32),
    (89, "fp16", 8, True, False, 32), (89, "bf16", 4, True, True, 16), (90, "bf16", 8, False, True, 16),
]


def test_decode_and_prefill_shapes_compile_for_sm89_and_sm90_without_spills(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    result = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(CASES)], capture_output=True, text=True,
                            timeout=600, cwd=tmp_path, env=env)
    if result.returncode != 0 and "ptxas" in result.stderr and "No such file" in result.stderr:
        pytest.skip("this triton ships no ptxas")
    assert result.returncode == 0, result.stderr[-3000:]
    usage = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(usage) == len(CASES)
    for case, used in zip(CASES, usage, strict=True):
        assert used["stack"] == 0, f"{case} spills {used['stack']} bytes to local memory ({used['regs']} registers)"
