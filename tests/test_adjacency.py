import pytest
import torch

from graft_block.adjacency import AdjacencyMatrix, slow_update_reference
from graft_block.errors import ConfigError


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_update_matches_slow_reference_with_repeated_tokens(dtype):
    g = torch.Generator().manual_seed(0)
    V, k = 50, 5
    m = AdjacencyMatrix(V, k, dtype)
    ref = m.table.clone()
    for step in range(20):
        n = int(torch.randint(1, 40, (1,), generator=g))
        # Few distinct tokens so repeats are common: the last occurrence must win in both implementations.
        tokens = torch.randint(0, 12 if step % 2 else V, (n,), generator=g)
        logits = torch.randn(n, V, generator=g)
        m.update(tokens, logits)
        ref = slow_update_reference(ref, tokens, logits)
        assert torch.equal(m.table, ref), f"step {step}"
    assert m.table.dtype == dtype
    assert m.updates > 0


def test_last_write_wins_explicitly():
    m = AdjacencyMatrix(6, 2)
    logits = torch.tensor([[0, 9, 8, 0, 0, 0], [0, 0, 0, 7, 9, 0], [5, 0, 0, 0, 0, 9.0]])
    m.update(torch.tensor([3, 1, 3]), logits)
    assert m.table[3].tolist() == [5, 0]
    assert m.table[1].tolist() == [4, 3]
    assert m.table[0].tolist() == [-1, -1]  # never written: unknown
    assert m.filled_rows == 2


def test_nbytes_save_load_and_errors(tmp_path):
    m = AdjacencyMatrix(100, 3, "int32")
    assert m.nbytes == 100 * 3 * 4
    assert AdjacencyMatrix(100, 8, torch.int64).nbytes == 100 * 8 * 8
    m.update(torch.tensor([4, 7]), torch.randn(2, 100))
    m.save(tmp_path / "adj.safetensors")
    m2 = AdjacencyMatrix.load(tmp_path / "adj.safetensors")
    assert torch.equal(m.table, m2.table) and m2.k == 3 and m2.updates == 2
    with pytest.raises(ConfigError, match="out of range"):
        m.update(torch.tensor([100]), torch.randn(1, 100))
    with pytest.raises(ConfigError, match="logits"):
        m.update(torch.tensor([1, 2]), torch.randn(3, 100))
    with pytest.raises(ConfigError, match="int32 or int64"):
        AdjacencyMatrix(10, 2, torch.float32)
    with pytest.raises(ConfigError, match="k"):
        AdjacencyMatrix(10, 11)


def test_observe_adapter_uses_every_verified_node():
    from types import SimpleNamespace

    from graft_block.tree import make_tree

    tree = make_tree([5, 1, 2, 1], [-1, 0, 0, 1])
    logits = torch.randn(4, 20)
    m = AdjacencyMatrix(20, 4)
    m.observe(SimpleNamespace(tree=tree, logits=logits))
    assert torch.equal(m.table, slow_update_reference(AdjacencyMatrix(20, 4).table, tree.tokens, logits))


def test_warmup_fills_rows_from_target_greedy_continuation(tiny_llama):
    t = tiny_llama
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    m = AdjacencyMatrix(t.vocab_size, 4)
    assert m.warmup(t, prompts, rounds=0) == 0 and m.filled_rows == 0
    assert m.warmup(t, prompts, rounds=2, new_tokens=8) == 2
    # Reference: the same two sequences, written position by position.
    ref = AdjacencyMatrix(t.vocab_size, 4).table
    with torch.inference_mode():
        for p in prompts:
            ids = t.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=8, do_sample=False)
            logits = t.model(input_ids=ids).logits[0]
            ref = slow_update_reference(ref, ids[0], logits)
    assert torch.equal(m.table, ref)
    assert m.filled_rows > 5


def test_update_refuses_logits_wider_than_the_matrix():
    """Logits over a larger vocabulary used to be accepted: their top-k stored ids with no row, and the next
    expansion from that row indexed past the table (an IndexError on CPU, a device-side assert on a GPU)."""
    from graft_block.tree.templates import expand_template

    m = AdjacencyMatrix(10, 2)
    logits = torch.zeros(1, 20)
    logits[0, 15] = 5.0
    with pytest.raises(ConfigError, match="10 rows"):
        m.update(torch.tensor([1]), logits)
    assert m.filled_rows == 0 and m.updates == 0
    m.update(torch.tensor([1, 2]), torch.eye(10)[[2, 3]])  # the matrix's own width is fine: row 1 -> 2 -> 3
    assert expand_template(1, [[0], [0, 0]], m).tokens.tolist() == [1, 2, 3]


@pytest.mark.parametrize("bad", [100, 12345, -2])
def test_load_refuses_successor_ids_outside_the_vocabulary(tmp_path, bad):
    """A corrupt or foreign file was loaded as it came: a stored id >= vocab_size then indexed past the table at the
    next template expansion (an IndexError on CPU, a device-side assert on a GPU), mid-decode."""
    from safetensors.torch import save_file

    from graft_block.tree.templates import expand_template

    m = AdjacencyMatrix(100, 3)
    m.update(torch.tensor([4, 7]), torch.eye(100)[[7, 9]])
    table = m.table.clone()
    table[7, 0] = bad  # row 4 -> 7 -> bad
    path = tmp_path / "adj.safetensors"
    save_file({"table": table}, str(path), metadata={"vocab_size": "100", "k": "3", "updates": "2"})
    with pytest.raises(ConfigError, match=rf"adj\.safetensors holds successor id {bad}, outside -1\.\.99.*save the"):
        AdjacencyMatrix.load(path)
    m.save(path)  # the matrix's own file loads and expands
    assert expand_template(4, [[0], [0, 0]], AdjacencyMatrix.load(path)).tokens.tolist() == [4, 7, 9]


def test_load_refuses_a_table_its_metadata_or_dtype_contradicts(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "adj.safetensors"
    save_file({"table": torch.full((50, 2), -1, dtype=torch.int32)}, str(path), metadata={"vocab_size": "100"})
    with pytest.raises(ConfigError, match=r"adj\.safetensors: metadata vocab_size='100' but the table is \[50, 2\]"):
        AdjacencyMatrix.load(path)
    save_file({"table": torch.zeros(10, 2)}, str(path))
    with pytest.raises(ConfigError, match=r"adjacency matrix file .*adj\.safetensors: adjacency dtype .*float32"):
        AdjacencyMatrix.load(path)
