"""GPTConfig arithmetic and the loss of half-precision logits (no processes)."""

from __future__ import annotations

import re

import pytest
import torch

from distllm.models.config import GPTConfig
from distllm.models.gpt import splits_vocab


def test_vocabulary_padded_to_64_per_tp_rank():
    assert [GPTConfig(vocab_size=256).padded_vocab(tp) for tp in (1, 2, 4, 8)] == [
        256, 256, 256, 512]
    assert [GPTConfig(vocab_size=123).padded_vocab(tp) for tp in (1, 2, 3)] == [128, 128, 192]


def test_small_vocabulary_is_held_whole_under_tp():
    # auto: split unless vocab * (tp - 1) <= 2 * hidden; one rank always "splits" (the same
    # modules)
    assert splits_vocab(256, 128, tp=2) is False
    assert splits_vocab(257, 128, tp=2) is True
    assert splits_vocab(256, 128, tp=4) is True
    assert splits_vocab(256, 384, tp=4) is False
    assert splits_vocab(256, 768, tp=2) is False
    assert splits_vocab(50257, 768, tp=4) is True
    assert splits_vocab(51200, 25600, tp=8) is True
    assert splits_vocab(256, 128, tp=1, choice="off") is True
    assert splits_vocab(50257, 768, tp=2, choice="off") is False
    assert splits_vocab(256, 128, tp=2, choice="on") is True
    # sequence parallelism keeps the split; asking for the whole one there names the knobs
    assert splits_vocab(256, 128, tp=2, sequence_parallel=True) is True
    with pytest.raises(ValueError, match="--vocab-parallel auto.*--sequence-parallel"):
        splits_vocab(256, 128, tp=2, sequence_parallel=True, choice="off")
    with pytest.raises(ValueError, match="vocab_parallel='sometimes'"):
        splits_vocab(256, 128, tp=2, choice="sometimes")


@pytest.mark.parametrize("name", ["tiny", "gpt2-small"])
def test_flops_per_token_counts_each_matmul_weight_once(name):
    from dataclasses import replace

    from distllm.plan import preset

    c = GPTConfig.preset(name)
    h, f, L, v, s = c.hidden_size, c.ffn_hidden_size, c.n_layers, c.vocab_size, c.max_seq_len
    # 6 per weight of the blocks' GEMMs and the head (the input embedding is a lookup), plus
    # the attention scores and their weighting
    closed = 6 * (L * (4 * h * h + 2 * h * f) + v * h) + 12 * L * h * s
    assert c.flops_per_token(s) == closed
    assert replace(c, tie_embeddings=not c.tie_embeddings).flops_per_token(s) == closed
    if name == "gpt2-small":
        assert closed == 854_438_400
    # the planner counts the same, its head over the padded vocabulary
    shape = preset(name)
    planner = shape.model_flops_per_step() / (shape.global_batch * shape.seq_len)
    pad = 6 * (c.padded_vocab(1) - v) * h
    assert planner == pytest.approx(c.flops_per_token(shape.seq_len) + pad, rel=1e-15)


def test_flops_per_token_with_grouped_query_attention():
    c = GPTConfig(vocab_size=100, n_layers=3, hidden_size=64, n_heads=8, n_kv_heads=2,
                  ffn_hidden_size=160, max_seq_len=16)
    h, d = 64, 8
    qkv = h * (h + 2 * 2 * d)  # 8 query heads, 2 key and 2 value heads of 8
    assert c.flops_per_token(7) == 6 * (3 * (qkv + h * h + 2 * h * 160) + 100 * h) + 12 * 3 * h * 7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loss_of_half_logits_is_an_fp32_softmax(dtype):
    from distllm import ParallelDims
    from distllm.models.gpt import gpt_loss

    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(4, 8, 300, generator=g, dtype=torch.float64)).to(dtype)
    tgt = torch.randint(300, (4, 8), generator=g)
    dims = ParallelDims(tp=1, pp=1, dp=1)
    loss = gpt_loss(logits, tgt, dims)
    ref = torch.nn.functional.cross_entropy(logits.double().reshape(-1, 300), tgt.reshape(-1))
    assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) < 1e-5 * ref.item()


def test_ids_in_the_vocabulary_padding_and_overlong_sequences_are_refused():
    """vocab 123 is padded to 128 rows: an input id or a target in [123, 128) was taken (the
    target's loss read inf) where the unpadded table raised; a sequence longer than
    max_seq_len gave a broadcast error, or under sequence parallelism reused the last
    position's row."""
    from distllm import ParallelDims
    from distllm.models.gpt import GPT

    cfg = GPTConfig(vocab_size=123, n_layers=1, hidden_size=32, n_heads=2,
                    ffn_hidden_size=64, max_seq_len=8)
    model = GPT(cfg, ParallelDims(tp=1, pp=1, dp=1))
    ids = torch.randint(123, (2, 8))
    loss = model.loss(model(ids), ids)
    assert torch.isfinite(loss)
    bad = ids.clone()
    bad[1, 3] = 125
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 123\)"):
        model(bad)
    with pytest.raises(ValueError, match=r"GPT: targets must be in \[0, 123\)"):
        model.loss(model(ids), bad)
    with pytest.raises(ValueError, match="a sequence of 9 tokens is longer than max_seq_len=8"):
        model(torch.randint(123, (2, 9)))
    with pytest.raises(ValueError, match=r"GPT takes \(batch, seq\) token ids, got shape "
                                         r"\(8,\): for one sequence pass tokens.unsqueeze\(0\)"):
        model(ids[0])


@pytest.mark.parametrize(("kv", "says"), [
    (0, "GPTConfig.n_kv_heads=0: give a positive number of heads, or None (as many as "
        "n_heads)"),
    (3, "n_kv_heads=3 does not divide n_heads=4"),
])
def test_n_kv_heads_must_be_none_or_a_divisor(kv, says):
    """0 was read as "as many as n_heads", silently."""
    with pytest.raises(ValueError, match=re.escape(says)):
        GPTConfig(n_kv_heads=kv)
    assert GPTConfig(n_kv_heads=None).kv_heads == GPTConfig().n_heads


def _block_run(checkpointing: str) -> tuple[int, int, dict]:
    """Bytes a float64 GPT block keeps for backward, the QKV GEMMs its forward and backward
    ran, and its gradients."""
    from distllm.models.gpt import Block
    from distllm.parallel import ParallelDims

    cfg = GPTConfig(n_layers=1, hidden_size=16, n_heads=2, ffn_hidden_size=32, max_seq_len=64)
    torch.manual_seed(0)
    block = Block(cfg, ParallelDims(), checkpointing=checkpointing, dtype=torch.float64)
    torch.manual_seed(1)
    x = torch.randn(2, 64, 16, dtype=torch.float64, requires_grad=True)
    calls = []
    block.attn.qkv.register_forward_hook(lambda *a: calls.append(1))
    kept: dict[int, int] = {}

    def pack(t):
        kept.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    from torch.nn.attention import SDPBackend, sdpa_kernel

    # the math kernel keeps the (b, heads, s, s) scores, as attention without a fused
    # kernel does (CPU's and CUDA's flash kernels keep a log-sum-exp per row instead)
    with sdpa_kernel(SDPBackend.MATH):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block(x)
        y.square().sum().backward()
    grads = {n: p.grad for n, p in block.named_parameters()}
    grads["x"] = x.grad
    return sum(kept.values()), len(calls), grads


def test_selective_recomputation_keeps_qkv_and_recomputes_the_attention_core():
    """``selective`` is Megatron-LM's: the attention core (the softmax over the scores) is
    recomputed in backward from the Q, K, V it keeps; no GEMM runs twice (the attention
    half, QKV GEMM and its collective included, had been recomputed)."""
    none, n_calls, ref = _block_run("none")
    sel, s_calls, grads = _block_run("selective")
    full, f_calls, _ = _block_run("full")
    assert (n_calls, s_calls, f_calls) == (1, 1, 2)
    scores = 2 * 2 * 64 * 64 * 8  # (b, heads, s, s) float64 softmax
    assert none - sel >= scores and sel > full, (none, sel, full)
    for k, g in ref.items():
        torch.testing.assert_close(grads[k], g, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("layer_norm_eps", -1.0, "GPTConfig.layer_norm_eps=-1.0: it must be a finite number > 0"),
    ("layer_norm_eps", 0, "GPTConfig.layer_norm_eps=0: it must be a finite number > 0"),
    ("layer_norm_eps", float("nan"), "GPTConfig.layer_norm_eps=nan: it must be a finite"),
    ("layer_norm_eps", "1e-5", "GPTConfig.layer_norm_eps='1e-5': it must be a finite"),
    ("layer_norm_eps", True, "GPTConfig.layer_norm_eps=True: it must be a finite"),
    ("init_std", -0.02, "GPTConfig.init_std=-0.02: it must be a finite number >= 0"),
    ("init_std", float("inf"), "GPTConfig.init_std=inf: it must be a finite number >= 0"),
    ("init_std", None, "GPTConfig.init_std=None: it must be a finite number >= 0"),
    ("tie_embeddings", "no", "GPTConfig.tie_embeddings='no': it must be a bool"),
    ("tie_embeddings", 1, "GPTConfig.tie_embeddings=1: it must be a bool"),
    ("n_layers", True, "GPTConfig.n_layers=True: it must be a positive integer"),
])
def test_norm_epsilon_init_std_and_tying_are_checked(field, value, says):
    """A meta.json with layer_norm_eps=-1.0 exported a NaN model; "tie_embeddings": "no" was
    taken as true."""
    with pytest.raises(ValueError, match=re.escape(says)):
        GPTConfig(**{field: value})


def test_whole_numbers_are_taken_for_the_float_fields():
    c = GPTConfig(layer_norm_eps=1, init_std=0, tie_embeddings=True)
    assert (c.layer_norm_eps, c.init_std, c.tie_embeddings) == (1, 0, True)


_TWO_BLOCKS = GPTConfig(vocab_size=64, n_layers=2, hidden_size=16, n_heads=2,
                        ffn_hidden_size=32, max_seq_len=8)


@pytest.mark.parametrize(("ids", "says"), [
    ([0, 1, 2, 3, 4], "layer_ids=[0, 1, 2, 3, 4]: 4 out of range: a model of 2 blocks has "
                      "layers 0 (the embedding), 1..2 (the blocks) and 3 (the head)"),
    ([-1, 0], "layer_ids=[-1, 0]: -1 out of range"),
    ([1, 1, 2], "layer_ids=[1, 1, 2]: give each layer once, in increasing order"),
    ([2, 1], "layer_ids=[2, 1]: give each layer once, in increasing order"),
    ([0, 1.0], "layer_ids=[0, 1.0]: each must be a whole number (0 the embedding, 1..2 the "
               "blocks, 3 the head)"),
    ([True], "layer_ids=[True]: each must be a whole number"),
])
def test_layer_ids_are_layers_of_the_model_each_once_in_order(ids, says):
    """An id past the head built an extra block; a repeated id ran its block twice."""
    from distllm import ParallelDims
    from distllm.models.gpt import GPT

    with pytest.raises(ValueError, match=re.escape(says)):
        GPT(_TWO_BLOCKS, ParallelDims(tp=1, pp=1, dp=1), layer_ids=ids)


def test_layer_ids_of_any_integer_type_are_taken():
    import numpy as np

    from distllm import ParallelDims
    from distllm.models.gpt import GPT

    dims = ParallelDims(tp=1, pp=1, dp=1)
    assert GPT(_TWO_BLOCKS, dims, layer_ids=[np.int64(1), 2]).layer_ids == [1, 2]
    assert GPT(_TWO_BLOCKS, dims, layer_ids=iter([3])).layer_ids == [3]
    assert GPT(_TWO_BLOCKS, dims).layer_ids == [0, 1, 2, 3]
