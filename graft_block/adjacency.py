"""The adjacency matrix of Token Recycling / Graft: row ``v`` holds the target's top-k next tokens, ranked, observed
after token ``v`` the last time ``v`` sat at a verified tree node. It lives on the target's device, is updated from
every verified node (accepted or rejected) and persists across prompts (reuse the object: a "hot start").

Rows never written hold -1 ("unknown"); template expansion drops such nodes instead of proposing token 0.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .errors import ConfigError

_DTYPES = {"int32": torch.int32, "int64": torch.int64, torch.int32: torch.int32, torch.int64: torch.int64}


class AdjacencyMatrix:
    def __init__(self, vocab_size: int, k: int = 8, dtype: torch.dtype | str = torch.int32, device="cpu"):
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ConfigError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        if not isinstance(k, int) or not 1 <= k <= vocab_size:
            raise ConfigError(f"k (successors per row) must be an int in 1..vocab_size={vocab_size}, got {k!r}")
        if dtype not in _DTYPES:
            raise ConfigError(f"adjacency dtype must be int32 or int64, got {dtype!r}")
        if _DTYPES[dtype] == torch.int32 and vocab_size > 2**31 - 1:
            raise ConfigError(f"vocab_size {vocab_size} does not fit int32 ids: use dtype=int64")
        self.vocab_size, self.k = vocab_size, k
        self.table = torch.full((vocab_size, k), -1, dtype=_DTYPES[dtype], device=device)
        self.updates = 0  # verified nodes written so far (warm-up included)

    # ---- facts ------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    @property
    def filled_rows(self) -> int:
        return int((self.table[:, 0] >= 0).sum())

    def to_(self, device) -> "AdjacencyMatrix":
        """Move the table to ``device`` in place, so every drafter or graft sharing this object follows it."""
        self.table = self.table.to(device)
        return self

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """[m] token ids -> [m, k] ranked successors (long, -1 = unknown)."""
        return self.table[tokens.to(self.device, torch.long)].to(torch.long)

    def check_target(self, target) -> None:
        """A ConfigError unless this matrix has one row per id of ``target``'s vocabulary: a smaller one cannot hold
        a row for every token, a larger one (another tokenizer) retrieves ids past the target's embedding table."""
        V = getattr(target, "vocab_size", None)
        if V is not None and self.vocab_size != int(V):
            raise ConfigError(f"adjacency matrix has vocab_size {self.vocab_size} but the target's vocabulary has {V} "
                              "ids: it was built for another target or tokenizer; build (or warm up) a new matrix "
                              "with AdjacencyMatrix(target.vocab_size, ...)")

    def __repr__(self) -> str:
        return (f"AdjacencyMatrix(vocab={self.vocab_size}, k={self.k}, dtype={self.table.dtype}, "
                f"device={self.device}, filled={self.filled_rows}, {self.nbytes} bytes)")

    # ---- updates ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Row ``tokens[i]`` := top-k of ``logits[i]`` for every i. A token repeated among ``tokens`` keeps the
        LAST occurrence's top-k (later positions are the more recent context), deterministically on any device."""
        tokens = torch.as_tensor(tokens).reshape(-1).to(self.device, torch.long)
        if logits.dim() != 2 or logits.shape[0] != tokens.numel():
            raise ConfigError(f"update needs logits [n, V] for n={tokens.numel()} tokens, got {tuple(logits.shape)}")
        if logits.shape[1] < self.k:
            raise ConfigError(f"logits have {logits.shape[1]} entries per row, fewer than k={self.k}")
        if logits.shape[1] > self.vocab_size:  # its top-k would store ids with no row: IndexError (GPU: assert) later
            raise ConfigError(f"logits have {logits.shape[1]} entries per row but this adjacency matrix has "
                              f"{self.vocab_size} rows: build it with the target's vocab_size ({logits.shape[1]})")
        if tokens.numel() == 0:
            return
        if int(tokens.max()) >= self.vocab_size or int(tokens.min()) < 0:
            raise ConfigError(f"token id out of range 0..{self.vocab_size - 1} for this adjacency matrix "
                              "(was it built for a different vocabulary?)")
        top = logits.to(self.device).topk(self.k, dim=-1).indices.to(self.table.dtype)  # [n, k]
        # Scatter with repeated indices has no defined winner, so pick the last occurrence of each token explicitly.
        uniq, inv = tokens.unique(return_inverse=True)
        pos = torch.arange(tokens.numel(), device=self.device)
        last = torch.full((uniq.numel(),), -1, dtype=torch.long, device=self.device)
        last.scatter_reduce_(0, inv, pos, reduce="amax")
        self.table[uniq] = top[last]
        self.updates += int(tokens.numel())

    def observe(self, verified, state=None) -> None:
        """Decoder adapter: update from every node of the verified tree with the logits of that same forward."""
        self.update(verified.tree.tokens, verified.logits)

    def reset(self) -> None:
        self.table.fill_(-1)
        self.updates = 0

    @torch.no_grad()  # not inference_mode: the target's cache, allocated here, is written in place later
    def warmup(self, target, prompts=None, rounds: int = 5, new_tokens: int = 64) -> int:
        """Fill the matrix from the target's own distributions: for each of ``rounds`` prompts (default: the
        ShareGPT *calibration* split, never an evaluation set) greedily generate ``new_tokens`` tokens, then write
        every position's top-k (prompt and reply) in order. Returns the number of prompts used."""
        if not isinstance(rounds, int) or rounds < 0:
            raise ConfigError(f"warm-up rounds must be an int >= 0, got {rounds!r}")
        if rounds == 0:
            return 0
        self.check_target(target)
        if prompts is None:
            if target.tokenizer is None:
                raise ConfigError("matrix warm-up on ShareGPT text needs a target with a tokenizer: pass token-id "
                                  "prompts, or warmup_rounds=0")
            from .data import sharegpt

            prompts = sharegpt("calibration", limit=rounds)
        with target.side_cache():  # a drafter warms up at prefill, in the middle of a decoding
            used = self._warm(target, prompts, rounds, new_tokens)
        if hasattr(target, "discard_features"):
            target.discard_features()  # feature hooks fired during warm-up; drop what they held
        return used

    def _warm(self, target, prompts, rounds: int, new_tokens: int) -> int:
        from .decoder import SpeculativeDecoder  # decoder imports target, which the matrix does not need otherwise

        used = 0
        for rec in list(prompts)[:rounds]:
            text = rec["turns"][0] if isinstance(rec, dict) else rec
            chat = isinstance(text, str) and target.tokenizer is not None
            msg = [{"role": "user", "content": text}] if chat else text
            ids = target.encode(msg).to(target.device).view(-1)
            budget = max(0, min(new_tokens, target.max_positions - ids.numel() - 1))
            if budget:  # the target's own greedy reply, on the engine that decodes (HF's weights stay unread)
                reply = SpeculativeDecoder(target).generate(ids, max_new_tokens=budget).tokens
                ids = torch.cat([ids, torch.tensor(reply, dtype=ids.dtype, device=ids.device)])
            self.update(ids, target.sequence_logits(ids))
            used += 1
        return used

    # ---- persistence ------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        save_file({"table": self.table.cpu().contiguous()}, str(path),
                  metadata={"vocab_size": str(self.vocab_size), "k": str(self.k), "updates": str(self.updates)})

    @classmethod
    def load(cls, path: str | Path, device="cpu") -> "AdjacencyMatrix":
        from safetensors import SafetensorError, safe_open

        if not Path(path).is_file():
            raise ConfigError(f"adjacency matrix file {path} is missing (or not a file): pass the path "
                              "AdjacencyMatrix.save wrote, or leave it out to build a new matrix")
        try:
            with safe_open(str(path), framework="pt") as fh:
                if "table" not in fh.keys():
                    raise ConfigError(f"adjacency matrix file {path} has no 'table' tensor (tensors: "
                                      f"{sorted(fh.keys())[:8]}): it is not a saved AdjacencyMatrix")
                table = fh.get_tensor("table")
                meta = fh.metadata() or {}
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"adjacency matrix file {path} is corrupt or truncated ({e}); save it again or build "
                              "a new matrix") from e
        if table.dim() != 2:
            raise ConfigError(f"{path} does not hold a [vocab, k] adjacency table")
        rows, k = int(table.shape[0]), int(table.shape[1])
        redo = "save the matrix again with AdjacencyMatrix.save, or build (or warm up) a new one"
        for name, have in (("vocab_size", rows), ("k", k)):  # save() writes both: a mismatch is a damaged file
            if name in meta and meta[name] != str(have):
                raise ConfigError(f"adjacency matrix file {path}: metadata {name}={meta[name]!r} but the table is "
                                  f"[{rows}, {k}]: the file is corrupt; {redo}")
        try:
            m = cls(rows, k, table.dtype, device)
        except ConfigError as e:
            raise ConfigError(f"adjacency matrix file {path}: {e}; {redo}") from None
        if table.numel():  # an id past the rows would index past the table mid-decode (GPU: a device-side assert)
            lo, hi = (int(v) for v in table.aminmax())
            if lo < -1 or hi >= rows:
                bad = lo if lo < -1 else hi
                raise ConfigError(f"adjacency matrix file {path} holds successor id {bad}, outside -1..{rows - 1} "
                                  f"(-1 = unknown, else one of its {rows} rows): it is corrupt or was not written "
                                  f"by AdjacencyMatrix.save for this vocabulary; {redo}")
        m.table.copy_(table.to(device))
        try:
            m.updates = int(meta.get("updates", 0))
        except ValueError:
            raise ConfigError(f"adjacency matrix file {path}: metadata updates={meta['updates']!r} is not an int; "
                              "save the matrix again") from None
        return m


def slow_update_reference(table: torch.Tensor, tokens, logits: torch.Tensor) -> torch.Tensor:
    """Per-node Python reference for tests: in node order, row tokens[i] := topk(logits[i]) (last write wins)."""
    out = table.clone()
    k = table.shape[1]
    for i, t in enumerate(torch.as_tensor(tokens).reshape(-1).tolist()):
        out[t] = logits[i].topk(k).indices.to(table.dtype)
    return out
