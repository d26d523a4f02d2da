"""FusedLinearGeLU and fuse(model): parity with Linear -> GeLU in float64 (values and
gradients), parameter sharing, Sequential and Hugging Face MLP blocks (GPT-2's Conv1D, BERT),
and what must be left alone.

Each parity test pins the fused layers' backend and runs once per backend this CPU machine
runs: ``cpu`` (oneDNN) in float64, and ``triton`` through its interpreter in float32 (Triton
has no float64), both against the unfused model in float64. ``auto`` picks by timing, so it
has its own test: the choice it made is recorded and is one of the candidates."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, GPT2Config
from transformers.activations import GELUActivation, NewGELUActivation, QuickGELUActivation
from transformers.models.bert.modeling_bert import BertIntermediate
from transformers.models.gpt2.modeling_gpt2 import GPT2Model

from distllm.nn import FusedLinearGeLU, fuse
from distllm.nn.fused import _FusedConv1DGeLU, gelu_approximate
from distllm.ops import backend_choice, backends

torch.manual_seed(0)
BACKENDS = ["cpu", "triton"]  # the fused backends that run on a CPU machine
DTYPE = {"cpu": torch.float64, "triton": torch.float32}
TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),  # the same math, another association order
    torch.float32: dict(rtol=2e-5, atol=2e-5),  # fp32 rounding of GEMMs over K <= 123, GeLU
}


@pytest.fixture
def ran(monkeypatch) -> dict[str, set[str]]:
    """The backends the fused op's forward and backward actually ran."""
    from distllm.ops import linear_gelu_backends as impl

    seen: dict[str, set[str]] = {"fwd": set(), "bwd": set()}
    # a whole MLP's backward is gemm_dgelu (the GeLU derivative in the second GEMM)
    for fn, phase in (("fwd", "fwd"), ("bwd", "bwd"), ("gemm_dgelu", "bwd")):
        real = getattr(impl, fn)

        def record(backend, *args, _real=real, _phase=phase):
            seen[_phase].add(backend)
            return _real(backend, *args)

        monkeypatch.setattr(impl, fn, record)
    return seen


def _need(backend: str) -> None:
    """The backend under test must run here; where it cannot (e.g. the Triton 3.6
    interpreter with numpy >= 2.4, which the torch-2.11 environment avoids by pinning
    numpy<2.4), the test fails with the reason rather than skipping the code under test."""
    status = backends()[backend]
    assert status.startswith("ok"), f"backend {backend!r} cannot run here: {status}"


def _pin(model: nn.Module, backend: str) -> int:
    """Run every fused layer of ``model`` on ``backend``; return how many there are."""
    fused = [m for m in model.modules() if isinstance(m, (FusedLinearGeLU, _FusedConv1DGeLU))]
    for m in fused:
        m.backend = backend
    return len(fused)


def _fused_copy(ref: nn.Module, backend: str, expect: int) -> nn.Module:
    """A copy of ``ref`` in the backend's dtype with its Linear -> GeLU pairs fused (``expect``
    of them) and pinned to ``backend``."""
    _need(backend)
    model = copy.deepcopy(ref).to(DTYPE[backend])
    assert fuse(model) == expect, f"fuse() swapped a different number of pairs than {expect}"
    assert _pin(model, backend) == expect
    return model


def _same_outputs_and_grads(ref: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    """``model`` (any dtype) against ``ref`` (float64): output, input grad, every param grad."""
    dtype = next(model.parameters()).dtype
    tol = TOL[dtype]
    xa, xb = x.clone().requires_grad_(), x.to(dtype).requires_grad_()
    ya, yb = ref(xa), model(xb)
    torch.testing.assert_close(yb.double(), ya, **tol, msg="output")
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g.to(dtype))
    torch.testing.assert_close(xb.grad.double(), xa.grad, **tol, msg="input grad")
    pa, pb = dict(ref.named_parameters()), dict(model.named_parameters())
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pb[k].grad.double(), pa[k].grad, **tol, msg=f"grad {k}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_layer_matches_linear_gelu(backend, approximate, bias, ran):
    lin = nn.Linear(123, 77, bias=bias, dtype=torch.float64)
    ref = nn.Sequential(lin, nn.GELU(approximate=approximate))
    _need(backend)
    fused = FusedLinearGeLU.from_linear(
        copy.deepcopy(lin).to(DTYPE[backend]), approximate, backend=backend
    )
    assert fused.backend == backend
    x = torch.randn(3, 7, 123, dtype=torch.float64).transpose(0, 1)  # 3-D, non-contiguous
    _same_outputs_and_grads(ref, nn.Sequential(fused, nn.Identity()), x)  # same param names
    assert ran == {"fwd": {backend}, "bwd": {backend}}, f"the fused op ran {ran}"


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuse_sequential_counts_and_keeps_outputs(backend, ran):
    ref = nn.Sequential(
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
    keys = set(ref.state_dict())
    model = _fused_copy(ref, backend, 2)
    assert isinstance(model[0], FusedLinearGeLU) and model[0].approximate == "tanh"
    assert isinstance(model[1], nn.Identity) and isinstance(model[3], nn.ReLU)
    assert isinstance(model[4][0], FusedLinearGeLU) and model[4][0].approximate == "none"
    assert type(model[5]) is nn.Linear and isinstance(model[7], nn.GELU)
    assert set(model.state_dict()) == keys  # checkpoints still load
    _same_outputs_and_grads(ref, model, torch.randn(5, 8, dtype=torch.float64))
    assert ran == {"fwd": {backend}, "bwd": {backend}}, f"the fused op ran {ran}"
    assert fuse(model) == 0  # idempotent


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_fuse_whole_mlp_fuses_its_backward_across_the_two_gemms(backend, approximate, monkeypatch):
    """Linear -> GeLU -> Linear becomes one function: the GeLU derivative goes into the second
    Linear's input-gradient GEMM (gemm_dgelu), the parameters keep their names."""
    from distllm.ops import linear_gelu_backends as impl

    ref = nn.Sequential(nn.Linear(8, 24), nn.GELU(approximate=approximate),
                        nn.Linear(24, 8)).double()
    keys = set(ref.state_dict())
    calls = []
    real = impl.gemm_dgelu
    monkeypatch.setattr(impl, "gemm_dgelu", lambda *a: calls.append(a[0]) or real(*a))
    _need(backend)
    model = copy.deepcopy(ref).to(DTYPE[backend])
    w2, b2 = model[2].weight, model[2].bias
    assert fuse(model) == 1 and _pin(model, backend) == 1
    assert isinstance(model[0], FusedLinearGeLU) and isinstance(model[1], nn.Identity)
    # the second Linear's slot holds its own Parameters, which the head computes with
    assert type(model[2]).__name__ == "_FusedAway" and model[0]._tail is model[2]
    assert model[2].weight is w2 and model[2].bias is b2
    assert set(model.state_dict()) == keys  # checkpoints still load
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    _same_outputs_and_grads(ref, model, torch.randn(2, 5, 8, dtype=torch.float64))
    assert calls == [backend], f"the fused MLP backward ran {calls}"
    assert fuse(model) == 0  # idempotent


def _penalty_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The parameters' gradients of a gradient penalty (a second derivative)."""
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
    return torch.autograd.grad(g.square().sum(), list(model.parameters()))


def test_a_fused_whole_mlp_refuses_a_second_derivative_and_mlp_false_gives_it():
    """The whole MLP's backward (gemm_dgelu) is differentiable once: a gradient penalty
    through it raises, in one line (it crashed inside the op); fuse(mlp=False) fuses the
    pair alone, whose second derivative equals the unfused model's in float64."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 24), nn.GELU(), nn.Linear(24, 8)).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    want = _penalty_grads(ref, x)
    whole = copy.deepcopy(ref)
    assert fuse(whole) == 1 and type(whole[2]).__name__ == "_FusedAway"
    with pytest.raises(RuntimeError, match="ParallelMLP is differentiable once"):
        _penalty_grads(whole, x)
    pair = copy.deepcopy(ref)
    assert fuse(pair, mlp=False) == 1
    assert isinstance(pair[0], FusedLinearGeLU) and type(pair[2]) is nn.Linear
    for g, w in zip(_penalty_grads(pair, x), want, strict=True):
        torch.testing.assert_close(g, w, **TOL[torch.float64])


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
@pytest.mark.parametrize("backend", BACKENDS)
def test_fuse_hf_style_block(act, n, backend, ran):
    ref = _Block(act).double()
    block = _fused_copy(ref, backend, n)
    assert isinstance(block.fc, FusedLinearGeLU) == bool(n)
    _same_outputs_and_grads(ref, block, torch.randn(2, 3, 8, dtype=torch.float64))
    want = {backend} if n else set()
    assert ran == {"fwd": want, "bwd": want}, f"the fused op ran {ran}"


def test_fuse_leaves_reused_outputs_and_linear_subclasses_alone():
    assert fuse(_UsesFcTwice(nn.GELU())) == 0
    assert fuse(nn.Sequential(_SubLinear(4, 4), nn.GELU())) == 0
    assert gelu_approximate(nn.ReLU()) is None and gelu_approximate(NewGELUActivation()) == "tanh"


class _TwoLine(_Block):  # h = fc(x); h = act(h), with an optional mask defaulting to None
    def forward(self, x, mask=None):
        h = self.fc(x)
        h = self.act(h)
        if mask is not None:  # between act and proj only when given: the MLP is not whole
            h = h.masked_fill(mask, 0.0)
        return self.proj(h)


class _MaskAny(_Block):  # a branch on the optional argument's values: cannot be traced given
    def forward(self, x, mask=None):
        h = self.act(self.fc(x))
        if mask is not None and mask.any():
            h = h.masked_fill(mask, 0.0)
        return self.proj(h)


class _SharedAct(nn.Module):  # one GeLU after two Linears: neither may turn it into identity
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(8, 8), nn.Linear(8, 8), nn.GELU()

    def forward(self, x):
        return self.act(self.fc1(x)) + self.act(self.fc2(x))


class _DataDependent(_Block):  # control flow on values: cannot be traced
    def forward(self, x):
        h = self.act(self.fc(x))
        return self.proj(h) if h.sum() > 0 else h.sum(-1, keepdim=True).expand(*h.shape[:-1], 8)


class _ThroughDropout(_Block):  # fc -> dropout -> act: not a Linear -> GeLU edge
    def __init__(self):
        super().__init__(nn.GELU())
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.proj(self.act(self.drop(self.fc(x))))


def test_fuse_two_line_block_with_an_optional_argument():
    ref = _TwoLine(functools.partial(F.gelu, approximate="tanh")).double()
    block = copy.deepcopy(ref)
    assert fuse(block) == 1  # fc -> act in every trace; act -> proj only with mask=None
    assert type(block.fc) is FusedLinearGeLU and block.fc.approximate == "tanh"
    assert type(block.proj) is nn.Linear
    assert "act" not in block._modules  # the function attribute stays a plain attribute
    _pin(block, "cpu")
    x = torch.randn(4, 8, dtype=torch.float64)
    _same_outputs_and_grads(ref, block, x)
    mask = torch.rand(4, 32) < 0.5
    torch.testing.assert_close(block(x, mask), ref(x, mask), **TOL[torch.float64])


@pytest.mark.parametrize(
    "make",
    [_SharedAct, lambda: _DataDependent(nn.GELU()), _ThroughDropout, lambda: _UsesFcTwice(F.gelu),
     lambda: _MaskAny(nn.GELU())],
    ids=["shared-act", "untraceable", "through-dropout", "fc-output-used-twice",
         "untraceable-given-an-optional-argument"],
)
def test_fuse_leaves_blocks_without_a_single_consumer_edge_alone(make, caplog):
    ref = make().double()
    block = copy.deepcopy(ref)
    before = {n: type(m) for n, m in block.named_modules()}
    with caplog.at_level(logging.DEBUG, logger="distllm"):
        assert fuse(block) == 0
    assert {n: type(m) for n, m in block.named_modules()} == before
    if not isinstance(ref.act, nn.Module):  # the function traced as a module is put back
        assert "act" not in block._modules and vars(block)["act"] is ref.act
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(block(x), ref(x), rtol=0, atol=0)
    if isinstance(ref, (_DataDependent, _MaskAny)):
        assert any("not traced" in r.getMessage() for r in caplog.records), caplog.records


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuse_gpt2_conv1d_mlp(backend, ran):
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
    ref = GPT2Model(cfg).double().eval()
    keys = {k: v.shape for k, v in ref.state_dict().items()}
    model = _fused_copy(ref, backend, 2)  # one c_fc (Conv1D, weight (in, out)) -> gelu_new
    assert isinstance(model.h[0].mlp.c_fc, _FusedConv1DGeLU)
    assert {k: v.shape for k, v in model.state_dict().items()} == keys  # Conv1D layout kept
    ids = torch.randint(0, 50, (2, 9))
    ya, yb = ref(ids).last_hidden_state, model(ids).last_hidden_state
    tol = TOL[DTYPE[backend]]
    torch.testing.assert_close(yb.double(), ya, **tol)
    # a random projection of the output: its plain sum is ln_f's output summed over the
    # hidden size, identically 0 at initialisation, whose gradients are rounding noise
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(0), dtype=ya.dtype)
    ya.backward(g)
    yb.backward(g.to(yb.dtype))
    pa, pb = dict(ref.named_parameters()), dict(model.named_parameters())
    assert pa.keys() == pb.keys()
    assert pa["h.0.mlp.c_fc.weight"].grad.abs().max() > 1e-3  # a gradient worth comparing
    for k in pa:
        torch.testing.assert_close(pb[k].grad.double(), pa[k].grad, **tol, msg=f"grad {k}")
    assert ran == {"fwd": {backend}, "bwd": {backend}}, f"the fused op ran {ran}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuse_bert_intermediate(backend, ran):
    ref = BertIntermediate(
        BertConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2)
    ).double()
    block = _fused_copy(ref, backend, 1)
    _same_outputs_and_grads(ref, block, torch.randn(3, 5, 32, dtype=torch.float64))
    assert ran == {"fwd": {backend}, "bwd": {backend}}, f"the fused op ran {ran}"


def test_fuse_auto_records_its_choice(monkeypatch):
    """fuse() leaves backend="auto": the first call of a shape measures the candidates and
    records the choice, which later calls reuse; the output is right whichever it picked."""
    ref = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).double()
    model = copy.deepcopy(ref).float()
    assert fuse(model) == 1, "fuse() did not swap the one Linear -> GELU pair"
    assert model[0].backend == "auto"
    backend_choice.clear()
    measured, real = [], backend_choice.measure
    monkeypatch.setattr(
        backend_choice, "measure", lambda c, *a, **k: measured.append(sorted(c)) or real(c, *a, **k)
    )
    x = torch.randn(33, 64, dtype=torch.float64)
    y = model(x.float())
    key = "linear_gelu|torch.float32|(rows<=64, 64)x(256, 64)|bias=True|none|grad=True"
    chosen = [v for k, v in backend_choice.cached().items() if k.endswith(key)]
    assert len(chosen) == 1, f"auto recorded no choice for {key}: {backend_choice.cached()}"
    # the backends (the Triton interpreter is never a candidate); the cpu backend's GEMMs
    # (oneDNN or torch's) are measured inside it, once per GEMM shape
    backends = [c for c in measured if "reference" in c]
    assert backends == [["cpu", "reference"]]
    assert all(c == ["onednn", "torch"] for c in measured if "reference" not in c)
    assert chosen[0] in backends[0]
    torch.testing.assert_close(y.double(), ref(x), **TOL[torch.float32])
    n = len(measured)
    model(x.float())
    assert len(measured) == n, "the second call measured again instead of reusing the choice"
