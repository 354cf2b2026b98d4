import os

# Triton kernels only launch on CPU in interpreter mode, which must be chosen before any @triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import graft_block  # noqa: E402,F401 - first, so OPENBLAS_THREAD_TIMEOUT is set before torch loads numpy
import pytest  # noqa: E402
import torch  # noqa: E402

# GRAFT_BLOCK_THREADS=1 lets a second, light test run share the 2 cores without OpenMP spin-waiting.
torch.set_num_threads(int(os.environ.get("GRAFT_BLOCK_THREADS", 0)) or max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def exact_draft_packs(monkeypatch):
    """Drafters keep their exact packs (float32, or float16 where exact) in tests, which compare them with
    reference forwards; where the machine's timed kernel choice puts a tiny target on skinny, bfloat16 drafting
    would otherwise decide which tests run exact. The bfloat16 path's own tests turn it back on."""
    monkeypatch.setenv("GRAFT_BLOCK_DRAFT_BF16", "0")


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded target (SmolLM2-135M-Instruct, fp32, CPU). Converted once, then cached."""
    from graft_block.target import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_llama():
    from graft_block.testing import tiny_target

    return tiny_target("llama")


@pytest.fixture(scope="session")
def tiny_qwen3():
    from graft_block.testing import tiny_target

    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster single-threaded (no intra-op overhead, no oversubscription); restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def refusal(monkeypatch, capsys):
    """``refusal(main, argv)``: the message a command gives for bad options, which must come before any target
    loads: argparse's usage error (exit status 2) or a ConfigError. Accepting the options fails the test."""
    from graft_block import target as target_module
    from graft_block.errors import ConfigError

    def no_load(*a, **k):
        raise AssertionError("the target loaded before the options were checked")

    monkeypatch.setattr(target_module, "load_target", no_load)

    def run(main, argv) -> str:
        try:
            main(argv)
        except SystemExit as exc:
            assert exc.code == 2
            return capsys.readouterr().err
        except ConfigError as exc:
            return str(exc)
        raise AssertionError(f"{argv} was accepted")

    return run
