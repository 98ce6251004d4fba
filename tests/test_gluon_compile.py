"""The Gluon kernels (kernels/moe_mma2.py, kernels/moe_simt.py, kernels/sparse_mla_ws.py) compile for sm_90 with the
installed Triton, on a machine without a GPU (Triton's own ptxas; scripts/gluon_sass.py).

Gluon is experimental and its API moves between releases (kernels/gluon_compat.py takes the
names that moved). At run time the ops use these kernels only on the releases in
kernels/device.py's GLUON_TRITON, where the GPU tests have run them; this test checks that
the code still compiles on every release it is known to compile with, so a rename breaks CI
instead of a GPU user's first call with the opt-in (DSV4LAB_GLUON_ANY_TRITON=1).
Explained in notebooks/02_mma_attention.ipynb.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)
import triton

ROOT = Path(__file__).resolve().parents[1]
# releases the Gluon kernels compile with (offline, sm_90): 3.6 (measured on the H200), 3.9
COMPILES_WITH = ((3, 6), (3, 9))
RELEASE = tuple(int(v) for v in re.findall(r"\d+", triton.__version__)[:2])

pytestmark = pytest.mark.skipif(
    RELEASE not in COMPILES_WITH,
    reason=f"the Gluon kernels are known to compile with Triton {COMPILES_WITH}, not {triton.__version__}")


@pytest.mark.parametrize("script, consts, mma", [
    # the MoE's T = 1 launch (moe.py _MMA2_T1): 96 mma.sync a program
    ("sass_moe_decode.py", '{"BN1": 32, "BN2": 32, "SPLIT1": 2, "SPLIT2": 1, "num_warps": 2, '
                           '"REGS": 4, "EVICT": true, "PREFETCH": false}', 96),
    # the T = 1 entry since session 22 (kernels/moe_simt.py): GEMVs on the CUDA cores, no mma
    ("sass_moe_decode.py", "--simt", 0),
    ("sass_moe_decode.py", "--simt {\"IS_NV\": true}", 0),
    # sparse MLA: the H200 table's bf16 mid/large launch and its FP8 large one; 72 wgmma
    # (two consumers: 32 for the scores, 4 for P V)
    ("sass_sparse_mla_ws.py", "{}", 72),
    ("sass_sparse_mla_ws.py", '{"NUM_BUF": 3, "FP8": true, "LAZY_SS": true, "SPLIT": 0}', 72),
    # with the KV gathers under L2 evict-first (EVICT_KV, kernels/l2_hint.py's PTX rewrite)
    ("sass_sparse_mla_ws.py", '{"EVICT_KV": true}', 72),
])
def test_gluon_kernels_compile_for_sm90(script, consts, mma, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = consts.split(" ", 1) if consts.startswith("--") else [consts]
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args,
                          "--out", str(tmp_path / "kernel")],
                         capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("triton ")][-1]
    assert line.startswith(f"triton {triton.__version__}, sm_90:")
    figures = dict(re.findall(r"(registers|MMA) (\d+)", line))
    assert int(figures["MMA"]) == mma, line
    assert 0 < int(figures["registers"]) <= 255, line
    assert (tmp_path / "kernel.sass").stat().st_size > 0
    if "sparse_mla" in script:
        # EVICT_KV: the bf16 ring's 16 masked copies a thread a tile (32 rows of 1 KB over 128
        # threads) hinted, Q's unmasked ones not; without it none
        hinted = (tmp_path / "kernel.ptx").read_text().count(".L2::cache_hint")
        assert hinted == (16 if "EVICT_KV" in consts else 0)
        # and the cubin is the hinted build (its descriptors passed l2_hint's SASS check)
        assert ("L2 hint hinted" in line) == ("EVICT_KV" in consts), line
