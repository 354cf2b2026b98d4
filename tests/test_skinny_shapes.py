"""The skinny kernel (graft_block/skinny.py) on degenerate shapes and inputs: what F.linear takes, it takes."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ON_CPU = os.environ.get("GRAFT_BLOCK_TEST_DEVICE", "cpu") == "cpu"


def _skinny():
    from graft_block import skinny

    if not ON_CPU or not skinny.available():
        pytest.skip(f"the skinny kernel does not build here: {skinny.why_not()}")
    return skinny


def test_products_of_no_rows_or_no_inputs_are_what_f_linear_gives():
    """0 rows through every packing (float32, float16, bfloat16, Q4_1, Q8_0) is an empty [0, out], and a weight of
    0 inputs gives the bias (zeros without). Run in a child: the old kernel divided by the row-group count and
    died of SIGFPE, which would take the whole test session down."""
    _skinny()
    script = r"""
import torch, torch.nn.functional as F
from graft_block import skinny
from graft_block.testing import gguf_quantised
g = torch.Generator().manual_seed(0)
w = torch.randn(40, 64, generator=g)
packs = [skinny.SkinnyWeight(w, half=False), skinny.SkinnyWeight(w.half().float()),
         skinny.SkinnyWeight(w, half="bf16"),
         skinny.SkinnyWeight(gguf_quantised(w, 4), quant=True), skinny.SkinnyWeight(gguf_quantised(w, 8), quant=True)]
precs = {p.prec for p in packs}
for p in packs:
    y = skinny.linear(torch.randn(0, 64), p)
    assert y.shape == (0, 40), y.shape
    assert skinny.linear(torch.randn(2, 0, 64), p).shape == (2, 0, 40)
    assert skinny.norm_linear(torch.randn(0, 64), torch.ones(64), 1e-5, p).shape == (0, 40)
b = torch.randn(5, generator=g)
for half in (None, False, "bf16"):
    empty_in = skinny.SkinnyWeight(torch.randn(5, 0), half=half, quant=True)
    x = torch.randn(3, 0)
    assert torch.equal(skinny.linear(x, empty_in), F.linear(x, torch.zeros(5, 0)))
    assert torch.equal(skinny.linear(x, empty_in, b), F.linear(x, torch.zeros(5, 0), b))
assert skinny.exact_quant(torch.randn(5, 0)) is None
print(sorted(precs))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_bf16_inputs_round_as_the_vector_conversion_does_in_the_tail_too():
    """Inputs past the last whole 32 are rounded to bfloat16 by scalar code, which must give what the vector
    conversion (and torch) give: nearest even, and a NaN stays a NaN (a NaN whose payload sits in the low 16 bits
    used to round up into infinity)."""
    skinny = _skinny()
    if not skinny._lib.bf16_weights():
        pytest.skip("bfloat16 products need an AVX512-BF16 CPU")
    n_in = 40  # 32 by the vector conversion, 8 by the scalar tail
    pw = skinny.SkinnyWeight(torch.eye(n_in), half="bf16")  # y = the bf16-rounded x, exactly
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, n_in, generator=g)
    tie = x[1].bfloat16().float().view(torch.int32) | 0x8000  # exactly half-way between two bfloat16 values
    x[1] = tie.view(torch.float32)
    low_nan = torch.tensor([0x7F800001, -0x007FFFFF], dtype=torch.int32).view(torch.float32)  # +NaN, -NaN
    x[2, 35], x[3, 36] = low_nan  # one a row: a NaN's products spread to every output of its row
    y = skinny.linear(x, pw)
    assert torch.equal(y[:2], x[:2].bfloat16().float())
    assert y[2, 35].isnan() and y[3, 36].isnan(), (y[2, 35], y[3, 36])
