"""FusedLinearGeLU and fuse(model): float64 parity with Linear -> GeLU (values and gradients),
parameter sharing, Sequential and Hugging Face MLP blocks (GPT-2's Conv1D, BERT), and what
must be left alone."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, GPT2Config
from transformers.activations import GELUActivation, NewGELUActivation, QuickGELUActivation
from transformers.models.bert.modeling_bert import BertIntermediate
from transformers.models.gpt2.modeling_gpt2 import GPT2Model

from distllm.nn import FusedLinearGeLU, fuse
from distllm.nn.fused import gelu_approximate

torch.manual_seed(0)
F64 = dict(rtol=1e-12, atol=1e-12)  # float64: the same math, different association order


def _same_outputs_and_grads(a: nn.Module, b: nn.Module, x: torch.Tensor) -> None:
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = a(xa), b(xb)
    torch.testing.assert_close(ya, yb, **F64)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, **F64)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pa[k].grad, pb[k].grad, **F64, msg=k)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_layer_matches_linear_gelu(approximate, bias):
    lin = nn.Linear(123, 77, bias=bias, dtype=torch.float64)
    ref = nn.Sequential(lin, nn.GELU(approximate=approximate))
    fused = FusedLinearGeLU.from_linear(copy.deepcopy(lin), approximate)
    x = torch.randn(3, 7, 123, dtype=torch.float64).transpose(0, 1)  # 3-D, non-contiguous
    ya = ref(x)
    yb = fused(x)
    torch.testing.assert_close(ya, yb, **F64)
    ya.sum().backward()
    yb.sum().backward()
    torch.testing.assert_close(lin.weight.grad, fused.weight.grad, **F64)
    if bias:
        torch.testing.assert_close(lin.bias.grad, fused.bias.grad, **F64)


def test_from_linear_shares_parameters_and_state_dict_keys():
    lin = nn.Linear(16, 8)
    fused = FusedLinearGeLU.from_linear(lin, "tanh")
    assert fused.weight is lin.weight and fused.bias is lin.bias
    assert fused.state_dict().keys() == lin.state_dict().keys()
    fresh = FusedLinearGeLU(16, 8)
    fresh.load_state_dict(lin.state_dict())
    assert "approximate='tanh'" in repr(fused)
    with pytest.raises(ValueError, match="approximate"):
        FusedLinearGeLU(4, 4, approximate="erf")
    with pytest.raises(ValueError, match="nn.Linear"):
        FusedLinearGeLU.from_linear(nn.Conv1d(2, 2, 1))


def test_fuse_sequential_counts_and_keeps_outputs():
    model = nn.Sequential(
        nn.Linear(8, 16),
        nn.GELU(approximate="tanh"),  # fused
        nn.Linear(16, 16),
        nn.ReLU(),  # other activation: left alone
        nn.Sequential(nn.Linear(16, 12), nn.GELU()),  # nested: fused
        nn.Linear(12, 12),
        nn.Dropout(0.0),
        nn.GELU(),  # not adjacent: left alone
        nn.Linear(12, 4),
    ).double()
    ref = copy.deepcopy(model)
    keys = set(model.state_dict())
    assert fuse(model) == 2
    assert isinstance(model[0], FusedLinearGeLU) and model[0].approximate == "tanh"
    assert isinstance(model[1], nn.Identity) and isinstance(model[3], nn.ReLU)
    assert isinstance(model[4][0], FusedLinearGeLU) and model[4][0].approximate == "none"
    assert type(model[5]) is nn.Linear and isinstance(model[7], nn.GELU)
    assert set(model.state_dict()) == keys  # checkpoints still load
    _same_outputs_and_grads(ref, model, torch.randn(5, 8, dtype=torch.float64))
    assert fuse(model) == 0  # idempotent


class _Block(nn.Module):  # Hugging Face-style: forward is act(fc(x))
    def __init__(self, act):
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.act = act
        self.proj = nn.Linear(32, 8)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class _UsesFcTwice(_Block):  # fc's output also feeds a residual: must not be fused
    def forward(self, x):
        h = self.fc(x)
        return self.proj(self.act(h) + h)


class _SubLinear(nn.Linear):
    pass


@pytest.mark.parametrize(
    "act,n",
    [
        (nn.GELU(), 1),
        (GELUActivation(), 1),
        (NewGELUActivation(), 1),
        (F.gelu, 1),
        (functools.partial(F.gelu, approximate="tanh"), 1),
        (QuickGELUActivation(), 0),
        (nn.SiLU(), 0),
    ],
)
def test_fuse_hf_style_block(act, n):
    block = _Block(act).double()
    ref = copy.deepcopy(block)
    assert fuse(block) == n
    assert isinstance(block.fc, FusedLinearGeLU) == bool(n)
    _same_outputs_and_grads(ref, block, torch.randn(2, 3, 8, dtype=torch.float64))


def test_fuse_leaves_reused_outputs_and_linear_subclasses_alone():
    assert fuse(_UsesFcTwice(nn.GELU())) == 0
    assert fuse(nn.Sequential(_SubLinear(4, 4), nn.GELU())) == 0
    assert gelu_approximate(nn.ReLU()) is None and gelu_approximate(NewGELUActivation()) == "tanh"


def test_fuse_gpt2_conv1d_mlp():
    cfg = GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=50,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2Model(cfg).double().eval()
    ref = copy.deepcopy(model)
    keys = {k: v.shape for k, v in model.state_dict().items()}
    assert fuse(model) == 2  # one c_fc (Conv1D, weight (in, out)) -> gelu_new per layer
    assert {k: v.shape for k, v in model.state_dict().items()} == keys  # Conv1D layout kept
    ids = torch.randint(0, 50, (2, 9))
    ya, yb = ref(ids).last_hidden_state, model(ids).last_hidden_state
    torch.testing.assert_close(ya, yb, **F64)
    ya.sum().backward()
    yb.sum().backward()
    ga, gb = ref.h[0].mlp.c_fc.weight.grad, model.h[0].mlp.c_fc.weight.grad
    torch.testing.assert_close(ga, gb, **F64)


def test_fuse_bert_intermediate():
    block = BertIntermediate(
        BertConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2)
    ).double()
    ref = copy.deepcopy(block)
    assert fuse(block) == 1
    _same_outputs_and_grads(ref, block, torch.randn(3, 5, 32, dtype=torch.float64))


def test_fuse_float32_within_rounding():
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    ref = copy.deepcopy(model)
    fuse(model)
    x = torch.randn(33, 64)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)  # fp32 GEMM reordering
