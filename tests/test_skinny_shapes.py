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


def test_bf16_products_at_input_widths_the_amx_tiles_do_not_take():
    """The AMX tiles step over 16 input pairs at a time: a width of 24 or 40 pairs (8 past a multiple of 16) must
    run the vector code and still give the product of the bfloat16-rounded inputs and weights, at 1 to 17 rows and
    at output counts off the 32-output blocks; 16 and 32 pairs (the tiles, where the CPU has them) too."""
    skinny = _skinny()
    if not skinny._lib.bf16_weights():
        pytest.skip("bfloat16 products need an AVX512-BF16 CPU")
    g = torch.Generator().manual_seed(2)
    for out, n_in in [(37, 48), (37, 80), (70, 32), (33, 64)]:
        w = torch.randn(out, n_in, generator=g)
        pw = skinny.SkinnyWeight(w, half="bf16")
        x = torch.randn(17, n_in, generator=g)
        xb, wb = x.bfloat16().double(), w.bfloat16().double()
        bound = 1e-6 * n_in * (xb.abs() @ wb.abs().T).max()
        for n in (1, 5, 16, 17):
            err = (skinny.linear(x[:n], pw).double() - xb[:n] @ wb.T).abs().max()
            assert err <= bound, (out, n_in, n, err)


def test_the_quant_argument_overrides_the_exact_quant_switch(monkeypatch):
    """``quant=True`` packs an exactly Q4_1 / Q8_0 weight in that form whatever GRAFT_BLOCK_EXACT_QUANT says (and
    keeps the float32 products bit for bit), ``quant=False`` keeps the float32 pack with the switch on."""
    skinny = _skinny()
    if not skinny._lib.quant_weights():
        pytest.skip("no skinny kernel with quantised loads here")
    from graft_block.testing import gguf_quantised

    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=g)
    for bits, prec in ((4, skinny.Q4), (8, skinny.Q8)):
        w = gguf_quantised(torch.randn(40, 64, generator=g), bits)
        full = skinny.linear(x, skinny.SkinnyWeight(w, half=False))
        monkeypatch.setenv(skinny.QUANT_ENV, "0")
        q = skinny.SkinnyWeight(w, quant=True)
        assert q.prec == prec and torch.equal(skinny.linear(x, q), full)
        monkeypatch.setenv(skinny.QUANT_ENV, "1")
        assert skinny.SkinnyWeight(w, quant=False).prec == skinny.F32
        assert skinny.SkinnyWeight(w).prec == prec


def test_what_the_kernel_cannot_take_is_refused_by_name(monkeypatch):
    """Rows of another dtype, row ids off either end of the weight, an unknown tile name, and model sizes the C
    layers cannot run are refused with a message, not run on reinterpreted memory; a key cache row holds every
    cache row in whole blocks."""
    skinny = _skinny()
    pw = skinny.SkinnyWeight(torch.randn(4, 8))
    with pytest.raises(ValueError, match="float32 CPU rows of 8"):
        skinny.linear(torch.randn(2, 8, dtype=torch.float64), pw)
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="row ids must lie in 0..3"):
            pw.rows(torch.tensor([0, bad]))
    monkeypatch.setenv("GRAFT_BLOCK_SKINNY", "avx1024")
    with pytest.raises(RuntimeError, match="GRAFT_BLOCK_SKINNY='avx1024': not one of avx512, avx2, generic"):
        skinny.variant()
    monkeypatch.delenv("GRAFT_BLOCK_SKINNY")
    vw = skinny.VARIANTS[skinny.variant()][0]
    assert skinny.layers_unsupported(64, 4, 2, 16) is None
    assert "must be multiples of the vector width" in skinny.layers_unsupported(64, 4, 2, 16 + vw // 2)
    assert "must be multiples of the vector width" in skinny.layers_unsupported(64 + vw // 2, 4, 2, 16)
    assert "odd or above 256" in skinny.layers_unsupported(64, 4, 2, 256 + vw)
    assert "do not split into 3 key/value groups" in skinny.layers_unsupported(64, 4, 3, 16)
    for cap in (1, 63, 64, 65, 100, 1000, 1024):
        rows = skinny.key_cache_shape(2, 3, 16, cap)[3]
        assert rows >= cap and rows % skinny.CAP_MULTIPLE == 0, (cap, rows)
