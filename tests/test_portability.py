"""Runs where it says: every launch the dispatch tables make in their default configurations
compiles offline for sm_80, sm_89, sm_90, sm_100 and sm_120 (Triton's own ptxas, no GPU), and
fits that GPU's shared memory per block.

Each family lists its launches (``offline_cases(props)``) for the GPU described by ``props``;
a kernel whose route does not run on a capability is not listed for it. Compiling needs
Triton's compiler rather than its interpreter, so each (family, GPU) compiles in a child
process with TRITON_INTERPRET=0.
"""
import json
import os
import subprocess
import sys

import pytest

from dsv4lab.kernels.device import CAPABILITIES

FAMILIES = {
    "attention": "dsv4lab.kernels.attention.dispatch",
    "indexer": "dsv4lab.kernels.indexer",
    "moe": "dsv4lab.kernels.moe.dispatch",
    "mhc": "dsv4lab.kernels.mhc",
    "linear": "dsv4lab.kernels.linear",
    "stream_read": "dsv4lab.kernels.stream_read",
}

CHILD = r"""
import importlib, json, sys
import dsv4lab  # TRITON_INTERPRET=0: compile, do not interpret
from dsv4lab.kernels import offline
from dsv4lab.kernels.device import DeviceProps
module, cap = sys.argv[1], tuple(int(c) for c in sys.argv[2].split(","))
props = DeviceProps.nominal(cap)
out = []
for case in importlib.import_module(module).offline_cases(props):
    k = offline.compile_case(case, props)
    out.append(dict(name=case.name, shared=k.metadata.shared, limit=props.smem_per_block))
print("RESULT " + json.dumps(out))
"""


def _compile_family(module: str, cap) -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", CHILD, module, f"{cap[0]},{cap[1]}"],
                         capture_output=True, text=True, env=env, timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("cap", CAPABILITIES, ids=lambda c: f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_default_launches_compile_and_fit(family, cap):
    import importlib
    module = FAMILIES[family]
    try:
        importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} does not import: {e}")
    cases = _compile_family(module, cap)
    assert cases, f"{family} lists no launch for sm_{cap[0]}{cap[1]}: every op runs somewhere"
    for c in cases:
        assert c["shared"] <= c["limit"], (
            f"{family} / {c['name']} needs {c['shared']} B of shared memory on "
            f"sm_{cap[0]}{cap[1]}, which allows {c['limit']} B a block")
