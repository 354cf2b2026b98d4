"""Optional Triton kernel: the whole template gather of Token Recycling / Graft in ONE launch (the pure-torch path
in ``tree.templates.gather_template`` issues one gather per level). Same output: the token of every template node,
root first, -1 where unknown. Opt-in (``GRAFT_BLOCK_TRITON=1``) until measured on a GPU: it runs when Triton is
importable and the matrix is on a GPU (or, with ``force=True``, under ``TRITON_INTERPRET=1`` on CPU for tests);
otherwise the torch reference runs. Any output is a valid tree after de-duplication, so the kernel can only
change speed, never losslessness.
"""
from __future__ import annotations

import os

import torch

from graft_block.tree import SOURCE_RETRIEVED, Tree
from graft_block.tree.templates import compile_template, dedup_expansion, gather_template

try:  # Triton is an optional extra (pip install graft-block[triton]).
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_TRITON = False


if HAVE_TRITON:

    @triton.jit
    def _template_gather_kernel(table_ptr, parents_ptr, ranks_ptr, depths_ptr, out_ptr, n, k, max_depth,
                                BLOCK: tl.constexpr):
        # One program holds every node; levels run in order and a barrier publishes each level to the next.
        offs = tl.arange(0, BLOCK)
        live = offs < n
        par = tl.load(parents_ptr + offs, mask=live, other=0)
        rank = tl.load(ranks_ptr + offs, mask=live, other=0)
        depth = tl.load(depths_ptr + offs, mask=live, other=-1)
        for d in range(1, max_depth + 1):
            sel = live & (depth == d)
            ptok = tl.load(out_ptr + par, mask=sel, other=-1)
            ok = sel & (ptok >= 0) & (rank < k)
            tok = tl.load(table_ptr + ptok * k + rank, mask=ok, other=-1).to(tl.int64)
            tl.store(out_ptr + offs, tok, mask=sel)
            tl.debug_barrier()


def use_triton(table: torch.Tensor, force: bool = False) -> bool:
    if not HAVE_TRITON or not isinstance(table, torch.Tensor):  # a rows function has no device: the torch path
        return False
    if force:
        return table.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return table.is_cuda and os.environ.get("GRAFT_BLOCK_TRITON") == "1"


def gather_template_fused(root_token: int, template, table: torch.Tensor, force: bool = False) -> torch.Tensor:
    """``gather_template`` in one kernel launch; falls back to the torch reference without Triton."""
    if not use_triton(table, force):
        return gather_template(root_token, template, table)
    if table.dim() != 2 or not 0 <= int(root_token) < table.shape[0]:
        # the kernel would read outside the table (a crash or garbage rows): the reference names the problem
        return gather_template(root_token, template, table)
    ct = compile_template(template)
    n = ct.size + 1
    dev = table.device
    out = torch.full((n,), -1, dtype=torch.long, device=dev)
    out[0] = int(root_token)
    parents = ct.parents.clamp(min=0).to(dev)
    block = triton.next_power_of_2(n)
    max_depth = int(ct.depths.max())
    _template_gather_kernel[(1,)](table.contiguous(), parents, ct.ranks.to(dev), ct.depths.to(dev), out, n,
                                  table.shape[1], max_depth, BLOCK=block)
    return out


def expand(root_token: int, template, matrix, budget: int | None = None) -> Tree:
    """``tree.templates.expand_template`` for an ``AdjacencyMatrix`` (or [V, k] tensor), with the fused gather when
    enabled."""
    table = getattr(matrix, "table", matrix)
    toks = gather_template_fused(root_token, template, table)
    return dedup_expansion(toks, template, budget, SOURCE_RETRIEVED)
