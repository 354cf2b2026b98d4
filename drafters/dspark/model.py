"""The DSpark draft model: the DFlash backbone plus a low-rank Markov head and a confidence head.

Backbone: ``DFlashModel`` unchanged (same tensors, same KV injection of target features). DSpark adds two optional
heads, both keyed on the token *before* each draft row:
  - Markov head (``markov_rank`` r > 0): ``z_j = U_j + W2 W1[prev_j]`` with ``W1 = Embedding(V, r)`` and
    ``W2 = Linear(r, V, bias=False)``; U_j are the backbone's logits through the target's LM head. prev_0 is the
    block's anchor (the last committed token) and prev_j the token drafted at row j-1, so drafting is a loop of
    small products after one backbone forward. That is the ``vanilla`` head; DeepSpec's ``gated`` and ``rnn`` heads
    replace W1[prev_j] by a latent that also reads the row's hidden state h_j (the RNN: and a state carried along
    the block, i.e. every earlier draft; ``MarkovLatent``).
    ``markov_first_draft: false`` (ours; DeepSpec has no such switch) leaves draft 0 unbiased: its previous token
    is the anchor, which the backbone already reads, and a bias there only blurs the backbone's best row.
  - Confidence head: ``sigmoid(proj([h_j ; W1[prev_j]]))`` (or ``proj(h_j)`` without the Markov embedding), an
    estimate of P(draft j accepted | drafts < j accepted). It reads only drafts before j.
``markov_rank: 0`` with the confidence head off is a plain DFlash block drafter (DeepSpec's "DFlash").

Block alignment (a property of how a checkpoint was trained, never guessed at run time):
  - ``"zlab"``: block ``[anchor, mask x (B-1)]``, row k >= 1 predicts position start + k (B - 1 drafts);
  - ``"deepspec"``: the same block, row k >= 0 predicts start + k + 1 (B drafts; the anchor row predicts too).
``draft_offset`` is the first block row that drafts (1 or 0). Draft j always predicts start + j + 1.

Tensor names follow DeepSpec's (``markov_head.markov_w1.weight`` [V, r], ``markov_head.markov_w2.weight`` [V, r],
``markov_head.gate_proj`` [r, d + r] (gated), ``markov_head.joint_proj`` [3r, 2r + d] (rnn), both with biases,
``confidence_head.proj.weight`` [1, d (+ r)], ``.bias`` [1]), so native folders load by name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graft_block.errors import ConfigError

from ..dflash.model import DFlashModel

ALIGNMENTS = {"zlab": 1, "deepspec": 0}
MARKOV_TYPES = ("vanilla", "gated", "rnn")


class MarkovLatent(nn.Module):
    """What the three Markov heads share: the bias of draft j is W2 l_j, with a rank-r latent l_j per type
    (DeepSpec's ``markov_head_type``); e_j = W1[prev_j] and h_j the backbone's (normed) hidden state of row j:
      - ``vanilla``: l_j = e_j (a learned low-rank bigram);
      - ``gated``: l_j = sigmoid(G [h_j ; e_j] + g) * e_j (``gate_proj``: the row decides how much bigram it takes);
      - ``rnn``: [a; c; o] = J [s_{j-1} ; e_j ; h_j] + b, s_j = sigmoid(a) s_{j-1} + (1 - sigmoid(a)) tanh(c),
        l_j = tanh(o) (``joint_proj``; s_{-1} = 0): the state carries every earlier draft, not only the last.
    Subclasses give the basis: ``prev_embed`` (W1[prev]) and ``w2`` (W2's rows)."""

    def _init_kind(self, kind: str, rank: int, hidden_size: int) -> None:
        self.kind, self.hidden_size = kind, hidden_size
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    @property
    def stateful(self) -> bool:
        """True when a draft's bias depends on its whole path (the RNN), not only on its previous token."""
        return self.kind == "rnn"

    def hidden_terms(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The part of the type's projection that reads only h (its h columns plus the bias) for rows [..., H]; None
        for the vanilla head. It depends on the block row alone, so it is computed once per row."""
        if self.kind == "vanilla":
            return None
        lin = self.gate_proj if self.kind == "gated" else self.joint_proj
        cols = slice(0, self.hidden_size) if self.kind == "gated" else slice(lin.in_features - self.hidden_size, None)
        return F.linear(hidden.to(lin.weight.dtype), lin.weight[:, cols], lin.bias)

    def latent(self, emb: torch.Tensor, hidden_term: torch.Tensor | None = None,
               state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step: e [..., r] (W1[prev]), the row's ``hidden_terms`` (gated and RNN heads), the previous state
        [..., r] (RNN; None = zeros) -> (l [..., r], the new state or None)."""
        if self.kind == "vanilla":
            return emb, None
        if hidden_term is None:
            raise ConfigError(f"a {self.kind} Markov head reads each row's hidden state: pass its hidden_terms")
        hidden_term = hidden_term.to(emb.dtype)
        r = emb.shape[-1]
        if self.kind == "gated":  # gate_proj reads [h ; e]
            return torch.sigmoid(F.linear(emb, self.gate_proj.weight[:, self.hidden_size:]) + hidden_term) * emb, None
        if state is None:
            state = torch.zeros_like(emb)
        state = state.to(emb.dtype)  # joint_proj reads [s ; e ; h]
        proj = F.linear(torch.cat([state, emb], -1), self.joint_proj.weight[:, : 2 * r]) + hidden_term
        gate, cand, out = proj.chunk(3, -1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * state + (1.0 - gate) * torch.tanh(cand)

    def block_latents(self, prev: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced latents [..., L, r] of consecutive draft rows: prev [..., L] (row j's previous token),
        hidden [..., L, H]. The RNN runs along the last axis from a zero state, so it must start at draft 0."""
        emb = self.prev_embed(prev)
        if not self.stateful:
            return self.latent(emb, None if hidden is None else self.hidden_terms(hidden))[0]
        if hidden is None or prev.dim() < 1 or hidden.shape[:-1] != prev.shape:
            raise ConfigError("an RNN Markov head needs whole blocks: prev [..., L] and hidden [..., L, H] of "
                              "consecutive draft rows from draft 0")
        terms, state, out = self.hidden_terms(hidden), None, []
        for j in range(prev.shape[-1]):
            lat, state = self.latent(emb[..., j, :], terms[..., j, :], state)
            out.append(lat)
        return torch.stack(out, -2)


class MarkovHead(MarkovLatent):
    """DeepSpec's tables: W1 = Embedding(V, r), W2 = Linear(r, V, bias=False), plus the type's projection."""

    def __init__(self, vocab_size: int, rank: int, kind: str = "vanilla", hidden_size: int = 0):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self._init_kind(kind, rank, hidden_size)

    def prev_embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def w2(self, vocab: torch.Tensor | None = None) -> torch.Tensor:
        return self.markov_w2.weight if vocab is None else self.markov_w2.weight[vocab]


class EmbeddingMarkovHead(MarkovLatent):
    """A training-time Markov head in the target's embedding space: W1 = E A and W2 = E B, with E the target's
    frozen input embedding [V, H] and A, B [H, r] the basis's only parameters (a gated or RNN head adds its
    projection). A table W1[prev] learns only from the rows whose previous token is ``prev``; here every row trains
    the same 2 H r numbers, so tokens seen rarely borrow from their neighbours in E. It saves as the tables
    (``tables``), so checkpoints and drafting are unchanged."""

    def __init__(self, embed: torch.Tensor, rank: int, seed: int = 0, kind: str = "vanilla",
                 hidden_size: int = 0):
        super().__init__()
        self.register_buffer("embed", embed.detach(), persistent=False)
        g = torch.Generator().manual_seed(seed)
        scale = 0.02 / float(embed.detach().float().norm(dim=-1).mean())  # W1 rows start at the table's 0.02 scale
        self.a = nn.Parameter((torch.randn(embed.shape[1], rank, generator=g) * scale).to(embed))
        self.b = nn.Parameter(torch.zeros(embed.shape[1], rank).to(embed))  # W2 = 0: step 0 drafts as the backbone
        self._init_kind(kind, rank, hidden_size)

    def prev_embed(self, prev: torch.Tensor) -> torch.Tensor:
        return F.embedding(prev, self.embed) @ self.a

    def w2(self, vocab: torch.Tensor | None = None) -> torch.Tensor:
        return (self.embed if vocab is None else self.embed[vocab]) @ self.b

    def tables(self) -> MarkovHead:
        """The table head with W1 = E A and W2 = E B (what a checkpoint stores), the type's projection copied."""
        head = MarkovHead(self.embed.shape[0], self.a.shape[1], self.kind, self.hidden_size).to(self.a)
        with torch.no_grad():
            head.markov_w1.weight.copy_(self.embed @ self.a)
            head.markov_w2.weight.copy_(self.embed @ self.b)
            for name in ("gate_proj", "joint_proj"):
                if hasattr(self, name):
                    getattr(head, name).load_state_dict(getattr(self, name).state_dict())
        return head


class ConfidenceHead(nn.Module):
    def __init__(self, in_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[..., in_dim] -> confidence logits [...] (pre-sigmoid)."""
        return self.proj(features).squeeze(-1)


class DSparkModel(DFlashModel):
    """``DFlashModel`` + optional ``markov_head`` and ``confidence_head``; ``alignment`` says which block row
    drafts first. ``confidence_temperatures`` (per draft position, saved in the checkpoint config) hold
    the calibration of the confidence head (1 = uncalibrated); ``draft_temperatures`` (the same, ours) that of the
    draft distributions a tree ranks its nodes by: DeepSpec's L1 loss is no proper scoring rule, and its
    Markov-corrected rows come out overconfident (``calibrate.py``). Those are fitted to the target's greedy tokens;
    ``sampled_draft_temperatures`` (None = reuse them) to its samples, for trees drafted while the target samples."""

    def __init__(self, *args, markov_rank: int = 0, markov_head_type: str = "vanilla",
                 confidence_head: bool = False, confidence_with_markov: bool = True, alignment: str = "zlab",
                 markov_first_draft: bool = True, **kw):
        super().__init__(*args, **kw)
        if alignment not in ALIGNMENTS:
            raise ConfigError(f"block alignment must be one of {sorted(ALIGNMENTS)}, got {alignment!r} ('zlab': "
                              "row k>=1 predicts start+k; 'deepspec': row k>=0 predicts start+k+1)")
        if not isinstance(markov_rank, int) or markov_rank < 0:
            raise ConfigError(f"markov_rank must be an int >= 0 (0 = no Markov head), got {markov_rank!r}")
        if markov_head_type not in MARKOV_TYPES:
            raise ConfigError(f"markov_head_type {markov_head_type!r} is not one of {', '.join(MARKOV_TYPES)} "
                              "(DeepSpec's three Markov heads)")
        if confidence_head and confidence_with_markov and not markov_rank:
            raise ConfigError("confidence_head_with_markov needs a Markov head (markov_rank > 0): set "
                              "confidence_head_with_markov to false or give a rank")
        self.alignment = alignment
        self.draft_offset = ALIGNMENTS[alignment]
        self.markov_rank = markov_rank
        self.markov_head_type = markov_head_type
        # DeepSpec biases every draft; draft 0's previous token is the anchor, which the backbone already reads
        self.markov_first_draft = bool(markov_first_draft)
        V, H = self.config.vocab_size, self.config.hidden_size
        self.markov_head = MarkovHead(V, markov_rank, markov_head_type, H) if markov_rank else None
        self.confidence_with_markov = bool(confidence_head and confidence_with_markov)
        self.confidence_head = (ConfidenceHead(H + (markov_rank if self.confidence_with_markov else 0))
                                if confidence_head else None)
        # float32 on the CPU, not buffers: module.to(bfloat16) rounded them (1.37 -> 1.3672), and each read of a
        # GPU copy waited for the device
        self.confidence_temperatures = torch.ones(self.num_drafts)
        self.draft_temperatures = torch.ones(self.num_drafts)
        self.sampled_draft_temperatures: torch.Tensor | None = None

    def ranking_temperatures(self, temperature: float) -> torch.Tensor:
        """Per draft position, the temperature a tree's ranking reads the (already 1/``temperature``-scaled) draft
        logits at: fitted to greedy tokens at 0, to the target's samples above it when the checkpoint has those."""
        if temperature > 0 and self.sampled_draft_temperatures is not None:
            return self.sampled_draft_temperatures
        return self.draft_temperatures

    @property
    def num_drafts(self) -> int:
        """Drafts one block yields: B - 1 (zlab) or B (deepspec)."""
        return self.block_size - self.draft_offset

    def markov_latents(self, prev: torch.Tensor, hidden: torch.Tensor | None = None,
                       draft_index: torch.Tensor | None = None) -> torch.Tensor:
        """The Markov head's rank-r latents [..., r] of draft rows whose previous tokens are ``prev`` [...] and hidden
        states ``hidden`` [..., H] (gated and RNN heads); the bias is W2 times them (``markov_project``).
        ``draft_index`` [...]: each row's draft position j, needed when ``markov_first_draft`` is off (draft 0 then
        gets no bias) and for an RNN head, whose rows must be whole blocks (j = 0..L-1 along the last axis)."""
        if self.markov_head.stateful and (draft_index is None or prev.dim() < 1 or not torch.equal(
                draft_index, torch.arange(prev.shape[-1], device=prev.device).expand_as(draft_index))):
            raise ConfigError("an RNN Markov head needs whole blocks: prev [..., L], hidden [..., L, H] and "
                              "draft_index [..., L] running 0..L-1 (consecutive draft rows from draft 0)")
        lat = self.markov_head.block_latents(prev, hidden)
        if not self.markov_first_draft:
            if draft_index is None:
                raise ConfigError("this model's Markov head skips the first draft: pass each row's draft_index")
            lat = lat * (draft_index != 0).unsqueeze(-1).to(lat.dtype)
        return lat

    def markov_project(self, latent: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Latents [..., r] -> logit corrections W2 l [..., V'] (V' = ``vocab`` ids when given, else all)."""
        w2 = self.markov_head.w2(vocab)
        return F.linear(latent.to(w2.dtype), w2)

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """hidden [..., H] of draft rows, prev [...] their previous tokens -> pre-sigmoid confidences (None when the
        head is off). Uncalibrated: ``calibrated`` applies the per-position temperatures."""
        terms = self.confidence_terms(hidden)
        if terms is None:
            return None
        conf, w_emb = terms
        return conf if w_emb is None else conf + self.markov_head.prev_embed(prev).float() @ w_emb

    def confidence_terms(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The head is linear in [h ; W1[prev]]: (its h part plus bias, per row of ``hidden`` [..., H]; the weight
        on W1[prev] [r], None without it), so a drafter computes the h part once per block row (None: no head)."""
        if self.confidence_head is None:
            return None
        w = self.confidence_head.proj.weight.float()[0]
        H = hidden.shape[-1]
        return hidden.float() @ w[:H] + self.confidence_head.proj.bias.float(), \
            (w[H:] if self.confidence_with_markov else None)

    def calibrated(self, conf_logits: torch.Tensor, position: int) -> torch.Tensor:
        """Calibrated P(accept) of confidence logits at draft position ``position`` (0-based)."""
        return torch.sigmoid(conf_logits / float(self.confidence_temperatures[position]))


def from_dflash(base, markov_rank: int = 64, confidence_head: bool = True, alignment: str = "zlab",
                markov_head_type: str = "vanilla", seed: int = 0, markov_first_draft: bool = True) -> DSparkModel:
    """A DSpark model around a DFlash backbone's weights (shared tensors copied). The Markov head starts with
    W2 = 0, so the new model drafts exactly as the backbone did until it is trained; W1 starts random."""
    model = DSparkModel(base.config, base.block_size, base.target_layer_ids, base.mask_token_id,
                        base.num_target_layers, base.draft_vocab, markov_rank=markov_rank,
                        markov_head_type=markov_head_type, confidence_head=confidence_head,
                        confidence_with_markov=bool(confidence_head and markov_rank), alignment=alignment,
                        markov_first_draft=markov_first_draft)
    model.to(device=base.fc.weight.device, dtype=base.fc.weight.dtype)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    if unexpected or any(not (k.startswith("markov_head.") or k.startswith("confidence_head.")) for k in missing):
        raise ConfigError(f"cannot build DSpark from this backbone: missing {missing}, unexpected {unexpected}")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if model.markov_head is not None:
            w1 = model.markov_head.markov_w1.weight
            w1.copy_(torch.randn(w1.shape, generator=g).to(w1) * 0.02)
            model.markov_head.markov_w2.weight.zero_()
        if model.confidence_head is not None:
            p = model.confidence_head.proj
            p.weight.copy_(torch.randn(p.weight.shape, generator=g).to(p.weight) * 0.01)
            p.bias.zero_()
    return model
