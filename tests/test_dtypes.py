"""Device and dtype genericity of the decode path: half-precision targets and drafters on the CPU, and the target's
forwards on the "meta" device, which refuses host tensors mixed into its ops as a GPU does."""
import json
import types

import pytest
import torch
import torch.nn.functional as F

import graft_block.drafters.dflash as D
import graft_block.drafters.dspark as S
from graft_block import engine
from graft_block.decoder import SpeculativeDecoder
from graft_block.drafter import Drafter
from graft_block.drafters.eagle3 import Eagle3Drafter, Eagle3Head, build_draft_vocab, head_config_for, warm_start
from graft_block.errors import ConfigError
from graft_block.testing import hf_greedy, tiny_target
from graft_block.tree import chain, make_tree

PROMPT = [5, 17, 33, 2, 99, 64, 12]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def meta_target(monkeypatch, **kw):
    monkeypatch.setenv("GRAFT_BLOCK_TEST_DEVICE", "meta")
    return tiny_target(**kw)


def eagle3_head(target, seed=0):
    head = Eagle3Head(head_config_for(target, 64))
    d2t, t2d = build_draft_vocab(torch.rand(target.vocab_size, generator=torch.Generator().manual_seed(seed)), 64)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    warm_start(head, target)
    return head


@pytest.fixture
def row_invariant_kernels(monkeypatch):
    """Products and attention computed one row at a time, each tree row as a decode step computes it (attention over
    its visible keys, no mask): the CPU's half-precision GEMM and SDPA give other bits for a row beside others (or
    beside masked keys), so without this half-precision trees are not AR's whatever the code around them does."""
    sdpa, linear = F.scaled_dot_product_attention, F.linear

    def attention(q, k, v, attn_mask=None, is_causal=False, **kw):
        if attn_mask is None or q.shape[2] == 1:
            return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)
        rows = []
        for i in range(q.shape[2]):
            seen = (attn_mask[0, 0, i] == 0).nonzero().flatten()
            rows.append(sdpa(q[:, :, i:i + 1], k[:, :, seen], v[:, :, seen], **kw))
        return torch.cat(rows, 2)

    def product(x, weight, bias=None):
        flat = x.reshape(-1, x.shape[-1])
        return torch.cat([linear(flat[i:i + 1], weight, bias) for i in range(flat.shape[0])]).view(*x.shape[:-1], -1)

    functional = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    functional.scaled_dot_product_attention, functional.linear = attention, product
    monkeypatch.setattr(engine, "F", functional)
    monkeypatch.setattr(F, "linear", product)  # the LM head's nn.Linear


# ---- the target on a device ------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine_name", ["lean", "hf"])
def test_prefill_verify_and_compact_run_on_the_device(monkeypatch, engine_name):
    """Every op of prefill, a branching tree's verify and compaction runs on the target's device: compaction
    compared the walk's path with an arange on the device (torch.equal, a host wait every round on a GPU)."""
    t = meta_target(monkeypatch, arch="qwen3", dtype=torch.bfloat16, engine=engine_name)
    t.set_feature_layers([1, 2, 4])
    logits, feats = t.prefill(torch.tensor(PROMPT))
    assert logits.device.type == "meta" and logits.dtype == torch.bfloat16 and feats.shape == (7, 3 * t.hidden_size)
    tree = make_tree([9, 4, 6, 8, 3], [-1, 0, 0, 1, 2])
    logits, feats = t.verify(tree)
    assert logits.shape == (5, t.vocab_size) and feats.device.type == "meta" and t.cache_len == 12
    t.compact(5, torch.tensor([0, 2, 4]))
    assert t.cache_len == 10
    t.verify(chain(3, torch.tensor([1])))
    t.compact(2, torch.tensor([0, 1]))
    assert t.cache_len == 12


def test_lean_masked_attention_on_a_device_gives_sdpa_every_kv_head(monkeypatch):
    """On a GPU, SDPA's fused kernels take GQA (enable_gqa) only without a mask: a tree verify of a GQA target ran
    the math kernel. Masked forwards off the CPU repeat the kv heads instead (HF's rule); unmasked keep GQA."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, **kw):
        calls.append((attn_mask is not None, q.shape[1], k.shape[1], kw.get("enable_gqa", False)))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    functional = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    functional.scaled_dot_product_attention = record
    monkeypatch.setattr(engine, "F", functional)
    t = meta_target(monkeypatch, arch="llama", dtype=torch.bfloat16, engine="lean")  # 4 heads, 2 kv heads
    t.prefill(torch.tensor(PROMPT))
    t.verify(make_tree([9, 4, 6], [-1, 0, 0]))
    masked = [c for c in calls if c[0]]
    unmasked = [c for c in calls if not c[0]]
    assert masked and all(heads == kv and not gqa for _, heads, kv, gqa in masked)
    assert unmasked and all(heads == 2 * kv and gqa for _, heads, kv, gqa in unmasked)


def test_timers_wait_for_any_accelerator(monkeypatch):
    """Target.synchronize (every phase timer and the verify-cost timer) waited for CUDA only: an XPU's or MPS's
    queue ran past the timer."""
    t = tiny_target("llama", engine="hf")
    seen = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: seen.append(device))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append(("cuda", device)))
    t.synchronize()
    assert seen == []  # the CPU has no queue
    for dev in ("xpu:0", "cuda:1"):
        monkeypatch.setattr(t, "_device", torch.device(dev))
        t.synchronize()
    assert seen == [torch.device("xpu:0"), ("cuda", torch.device("cuda:1"))]


def test_hf_flash_attention_cannot_verify_trees():
    """HF's flash kernels read a 2-D padding mask: with a tree's additive 4-D mask they would read its 0 / min
    entries as padding. A multi-node verify on that path is refused; one node (a decode step) passes no mask."""
    t = tiny_target("llama", engine="hf")
    t.prefill(torch.tensor(PROMPT))
    t.config = types.SimpleNamespace(_attn_implementation="flash_attention_2")
    with pytest.raises(ConfigError, match="cannot apply a tree's ancestor mask.*attn_implementation='sdpa'"):
        t.verify(make_tree([9, 4, 6], [-1, 0, 0]))
    logits, _ = t.verify(chain(9, torch.tensor([], dtype=torch.long)))
    assert logits.shape == (1, t.vocab_size)


# ---- half precision: greedy identity ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("engine_name", ["lean", "hf"])
def test_half_precision_ar_is_hfs_greedy(dtype, engine_name):
    t = tiny_target("qwen3", dtype=dtype, engine=engine_name)
    assert SpeculativeDecoder(t).generate(PROMPT, max_new_tokens=24).tokens == hf_greedy(t, PROMPT, 24)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_trees_are_ar_with_row_invariant_kernels(dtype, row_invariant_kernels):
    """With products and attention computed per row as a decode step computes them, every drafter's half-precision
    rounds are token-identical to the same target's own greedy decoding: masks, positions, compaction and features lose
    nothing to the dtype."""
    t = tiny_target("qwen3", dtype=dtype, engine="lean")
    ar = SpeculativeDecoder(t).generate(PROMPT, max_new_tokens=24).tokens
    drafters = [Drafter.from_config({"type": "planted", "reference": ar, "budget": 8, "max_width": 3, "seed": 1,
                                     "vocab_size": 128}),
                Drafter.from_config({"type": "dflash", "block_size": 6, "budget": 6, "proposal": "ddtree"}, target=t),
                Drafter.from_config({"type": "dspark", "block_size": 6, "budget": 6, "proposal": "ddtree",
                                     "markov_rank": 4}, target=t),
                Eagle3Drafter(t, head=eagle3_head(t), budget=8, depth=3, top_k=3)]
    for d in drafters:
        res = SpeculativeDecoder(t, d).generate(PROMPT, max_new_tokens=24)
        assert res.tokens == ar, type(d).__name__
        assert res.stats.rounds < 24 or type(d).__name__ != "PlantedTreeDrafter"


# ---- drafters in another dtype than the target ---------------------------------------------------------------
@pytest.mark.parametrize("target_dtype,model_dtype", [(torch.bfloat16, torch.float32),
                                                      (torch.float32, torch.bfloat16)])
def test_a_dflash_drafter_in_another_dtype_than_its_target_drafts(target_dtype, model_dtype, row_invariant_kernels):
    """A DFlash model kept in its own dtype (a float32 training copy on a bfloat16 target, or the reverse) drafted
    into a dtype error: its hidden rows met the target's LM head rows unconverted."""
    t = tiny_target("qwen3", dtype=target_dtype, engine="lean")
    ar = SpeculativeDecoder(t).generate(PROMPT, max_new_tokens=16).tokens
    for vocab in (None, torch.arange(0, 128, 2)):
        model = D.new_model(t, block_size=6, draft_vocab=vocab).to(model_dtype)
        d = D.DFlashDrafter(t, model, proposal="ddtree", budget=5)
        assert SpeculativeDecoder(t, d).generate(PROMPT, max_new_tokens=16).tokens == ar


def test_dflash_forward_takes_its_mask_in_its_own_dtype():
    """A block mask built in the target's dtype (MFD builds it from the embeddings) reached SDPA in that dtype
    while the queries were already the model's: converted after the rows, it follows the model."""
    t = tiny_target("qwen3", dtype=torch.bfloat16, engine="hf")
    model = D.new_model(t, block_size=4).to(torch.float32)
    ctx = model.fuse(torch.randn(1, 5, 3 * t.hidden_size, dtype=torch.bfloat16))
    kv = model.context_kv(ctx, torch.arange(5).view(1, -1))
    embeds = t.embed(torch.tensor([3, 7, 7, 7]))  # bfloat16
    mask = torch.zeros(4, 9, dtype=torch.bfloat16)
    mask[:2, 7:] = torch.finfo(torch.bfloat16).min
    out = model(embeds, torch.arange(5, 9), kv, mask)
    assert out.dtype == torch.float32 and out.shape == (4, t.hidden_size) and bool(out.isfinite().all())


def test_dspark_calibration_temperatures_keep_float32_on_a_half_precision_target(tmp_path):
    """The fitted temperatures were buffers: loading on a bfloat16 target rounded them (1.37 -> 1.3671875), so
    the trees ranked by other numbers than the calibration's, and on a GPU every read waited for the device."""
    t32 = tiny_target("llama")
    model = S.from_dflash(D.new_model(t32, 2, 8, [0, 2], 120), markov_rank=4, confidence_head=True)
    temps = [1.37, 0.913, 2.71, 0.333333, 1.11, 0.77, 1.9]  # the config keeps 6 decimals
    model.confidence_temperatures = torch.tensor(temps)
    model.draft_temperatures = torch.tensor(temps[::-1])
    S.save_checkpoint(model, tmp_path / "ck", dtype=torch.float32, extra={"type": "dspark"})
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["dflash_config"]["confidence_temperatures"]
    t16 = tiny_target("llama", dtype=torch.bfloat16)
    d = Drafter.from_config({"type": "dspark", "checkpoint": str(tmp_path / "ck"), "proposal": "ddtree",
                             "budget": 6}, target=t16)
    assert d.model.fc.weight.dtype == torch.bfloat16
    for got, want in ((d.model.confidence_temperatures, temps), (d.model.draft_temperatures, temps[::-1])):
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        assert torch.equal(got, torch.tensor(want))
    d.model.to(torch.float16)
    assert d.model.draft_temperatures.dtype == torch.float32
    assert SpeculativeDecoder(t16, d).generate(PROMPT, max_new_tokens=6).stats.rounds >= 1


# ---- measurement -----------------------------------------------------------------------------------------------
def test_peak_gpu_memory_is_read_on_the_targets_gpu(monkeypatch):
    """The benchmark reset and read the peak memory of the current CUDA device (cuda:0), not the target's."""
    from graft_block.eval import measure

    seen = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: seen.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: seen.append(("peak", device)) or 0)
    target = types.SimpleNamespace(device=torch.device("cuda:1"), max_positions=64, tokenizer=None)
    method = types.SimpleNamespace(name="ar", budget=None, hooks=[],
                                   run=lambda ids, n, temp, seed, **kw: {"tokens": [1, 2], "decode_s": 1.0,
                                                                         "decode_tokens": 2})
    recs = measure.run_interleaved(target, [method], [{"id": "p", "turns": [[1, 2, 3]]}], 4, [0.0],
                                   progress=False, warmup_tokens=0)
    assert recs[0]["peak_gpu_mb"] == 0
    assert seen == [("reset", torch.device("cuda:1")), ("peak", torch.device("cuda:1"))]
