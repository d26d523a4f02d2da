"""Pipeline executor on gloo ranks vs the same model on one process (float64, ~1e-10).

Each rank builds the whole model from one seed, keeps its stages in a ``PipelineParallel``,
and computes the one-process reference itself (same layers, whole global batch), so a rank
compares its own stages' gradients with the reference's gradients of the same layers.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distllm.testing import run_distributed
from tests._errors import worst

VOCAB, HID, SEQ = 11, 6, 3
TOL = 1e-10  # float64: same ops in the same order per micro-batch; only sums regroup


class Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(h, 2 * h), nn.Linear(2 * h, h), nn.LayerNorm(h)

    def forward(self, x):  # (b, s, h) -> (b, s, h)
        return self.norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


def make_layers(n_blocks: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    layers = [nn.Embedding(VOCAB, HID)] + [Block(HID) for _ in range(n_blocks)]
    layers.append(nn.Linear(HID, VOCAB))
    return [layer.double() for layer in layers]


def loss_fn(logits, targets):  # (b, s, V), (b, s) -> mean over tokens
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (n, SEQ), generator=g)


def reference(n_blocks: int, x, y):
    layers = make_layers(n_blocks)
    model = nn.Sequential(*layers)
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.item(), {f"layers.{i}.{n}": p.grad.clone()
                         for i, layer in enumerate(layers) for n, p in layer.named_parameters()}


class AllReduceGrads:
    """Minimal data-parallel gradient sync: average grads over the DP group at the end; records
    when each parameter's post-accumulate-grad hook fired and whether under ``no_sync``."""

    def __init__(self, module: nn.Module, group, dp: int):
        self.module, self.group, self.dp, self.calls, self.in_no_sync = module, group, dp, 0, 0
        self.syncing, self.fired = True, []
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        self.fired.append((time.perf_counter(), self.syncing))

    @contextlib.contextmanager
    def no_sync(self):
        self.in_no_sync += 1
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def finish_grad_sync(self):
        self.calls += 1
        for p in self.module.parameters() if self.dp > 1 else ():
            dist.all_reduce(p.grad, group=self.group)
            p.grad /= self.dp


def _case(dims, schedule, m, v, n, n_blocks, seed, ddp=False, lps=None, by_fn=False,
          channels=None):
    from distllm.parallel import DistributedDataParallel
    from distllm.parallel.data.grad_norm import clip_grad_norm_
    from distllm.parallel.pipeline import PipelineParallel

    layers = make_layers(n_blocks)
    if by_fn:  # built layer by layer, only this rank's
        layers = layers.__getitem__
    pp = PipelineParallel(layers, dims, schedule, m, v, lps, num_layers=n_blocks + 2,
                          track_memory=seed % 2 == 0,  # saved-tensor hooks on, or off
                          p2p_channels=channels)  # True: one group per direction, as NCCL
    sync = pp.grad_sync = AllReduceGrads(pp, dims.dp_group, dims.dp)
    if ddp:  # the library's DDP reduces; the recorder above only watches the hooks
        sync.dp = 1
        pp.grad_sync = _Both(sync, DistributedDataParallel(
            pp.chunks, dims=dims, bucket_cap_mb=0.0005, first_bucket_mb=0.0002,
            finish_on_backward_end=not pp.schedule.split_backward))
    batches = [make_batch(n, seed + d) for d in range(dims.dp)]
    x, y = batches[dims.dp_rank]
    loss = pp.train_step(x if pp.is_first else None, y if pp.is_last else None, loss_fn)
    gx, gy = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    ref_loss, ref_grads = reference(n_blocks, gx, gy)
    local_ref = reference(n_blocks, x, y)[0]
    err = abs(loss - local_ref)
    names = [name for name, _ in pp.global_named_parameters()]
    assert len(names) == sum(1 for _ in pp.parameters()) and set(names) <= set(ref_grads)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, names)  # the stages together hold the whole model
    assert set().union(*every) == set(ref_grads), sorted(set(ref_grads) - set().union(*every))
    for name, p in pp.global_named_parameters():
        err = worst(err, float((p.grad - ref_grads[name]).abs().max()))
    # the optimizer's global gradient norm (over the pipeline's stages) sees the full model
    norm = clip_grad_norm_(pp.parameters(), 1e30, dims=dims)
    ref_norm = torch.stack([g.pow(2).sum() for g in ref_grads.values()]).sum().sqrt()
    err = worst(err, abs(float(norm) - float(ref_norm)))
    _check_hooks(pp, sync, m)
    ev = pp.eval_step(x, y, loss_fn)
    err = worst(err, abs(ev - local_ref))
    k = max(1, n // 2)  # another batch and micro-batch size: eval shapes may vary
    ev = pp.eval_step(x[:k], y[:k], loss_fn, micro_batches=1)
    err = worst(err, abs(ev - reference(n_blocks, x[:k], y[:k])[0]))
    return err, ref_loss


class _Both:
    def __init__(self, a, b):
        self.a, self.b = a, b

    @contextlib.contextmanager
    def no_sync(self):
        with self.a.no_sync(), self.b.no_sync():
            yield

    def finish_grad_sync(self):
        self.b.finish_grad_sync()
        self.a.finish_grad_sync()


def _check_hooks(pp, sync, m):
    """Weight grads accumulate (hooks fire) only inside B, and W with a split backward (the
    deferred linears' in W, the others' in B: none waits there); once per parameter and
    micro-batch; outside no_sync only in the rank's last pass of each kind (its last
    micro-batch's)."""
    split = pp.schedule.split_backward
    kinds = ("B", "W") if split else ("B",)
    spans = {k: [(t0, t1) for a, t0, t1 in pp.last_stats.timeline if a.kind == k]
             for k in kinds}
    n_params = sum(1 for _ in pp.parameters())
    assert sync.calls == 1
    assert len(sync.fired) == m * n_params, (len(sync.fired), m, n_params)
    in_w = [t for t, _ in sync.fired if any(t0 <= t <= t1 for t0, t1 in spans.get("W", []))]
    in_b = [t for t, _ in sync.fired if any(t0 <= t <= t1 for t0, t1 in spans["B"])]
    assert len(in_b) + len(in_w) == len(sync.fired)
    if split:  # every linear here is plain: W accumulates its weight and bias
        n_linear = sum(2 for mod in pp.modules() if type(mod) is nn.Linear)
        assert len(in_w) == m * n_linear and len(in_b) == m * (n_params - n_linear)
    outside = [t for t, syncing in sync.fired if syncing]
    last = [spans[k][-1] for k in kinds]
    assert outside and all(any(t0 <= t <= t1 for t0, t1 in last) for t in outside)


def _parity(cases, pp_size, dp=1):
    from distllm import ParallelDims

    dims = ParallelDims(tp=1, pp=pp_size, dp=dp)
    return [_case(dims, *c) for c in cases]


def _errors(cases, pp_size, dp=1):
    from distllm import ParallelDims
    from distllm.parallel.pipeline import PipelineParallel

    dims = ParallelDims(tp=1, pp=pp_size, dp=dp)
    out = []
    for kw in cases:
        try:
            pp = PipelineParallel(make_layers(kw.pop("n_blocks", 2)), dims, **kw.pop("init", {}))
            x, y = make_batch(kw["n"], 0)
            pp.train_step(x, y, loss_fn)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


# (schedule, m, v, batch, n_blocks, seed): m = p, 2p, not divisible by p, m < p, v = 2
CASES_2 = [
    ("gpipe", 2, 1, 4, 2, 1), ("gpipe", 3, 1, 3, 3, 2), ("gpipe", 1, 1, 2, 2, 3),
    ("1f1b", 2, 1, 2, 2, 4), ("1f1b", 4, 1, 8, 3, 5), ("1f1b", 3, 1, 6, 2, 6),
    ("1f1b", 1, 1, 1, 2, 7),
    ("interleaved-1f1b", 2, 2, 4, 2, 8), ("interleaved-1f1b", 4, 2, 4, 6, 9),
    ("zb-h1", 2, 1, 4, 2, 10), ("zb-h1", 5, 1, 5, 3, 11), ("zb-h1", 1, 1, 2, 2, 12),
    ("interleaved-1f1b", 2, 3, 2, 4, 13),  # v = 3
    ("1f1b", 3, 1, 3, 3, 14, False, [1, 4]), ("zb-h1", 2, 1, 2, 3, 15, False, [4, 1], True),
    ("interleaved-1f1b", 4, 2, 4, 2, 16, False, None, False, True),  # channels, p = 2 wrap
]

CASES_4 = [
    ("gpipe", 4, 1, 4, 2, 1), ("1f1b", 8, 1, 8, 2, 2), ("1f1b", 6, 1, 6, 3, 3),
    ("1f1b", 2, 1, 4, 2, 4), ("interleaved-1f1b", 4, 2, 4, 6, 5),
    ("interleaved-1f1b", 8, 2, 8, 6, 6), ("zb-h1", 4, 1, 4, 2, 7), ("zb-h1", 7, 1, 7, 2, 8),
    ("zb-h1", 3, 1, 3, 3, 9),
    # the NCCL layout (a process group per direction), exercised on gloo
    ("gpipe", 4, 1, 4, 2, 10, False, None, False, True),
    ("1f1b", 5, 1, 5, 2, 11, False, None, False, True),
    ("interleaved-1f1b", 4, 2, 4, 6, 12, False, None, False, True),
    ("zb-h1", 6, 1, 6, 2, 13, False, None, False, True),
]


def test_pipeline_parity_two_stages():
    res = run_distributed(_parity, 2, CASES_2, 2, timeout=240)
    for case, per_rank in zip(CASES_2, zip(*res, strict=False), strict=False):
        errs = [e for e, _ in per_rank]
        assert worst(errs) < TOL, (case, errs)


def test_pipeline_parity_four_stages():
    res = run_distributed(_parity, 4, CASES_4, 4, timeout=240)
    for case, per_rank in zip(CASES_4, zip(*res, strict=False), strict=False):
        errs = [e for e, _ in per_rank]
        assert worst(errs) < TOL, (case, errs)


def test_pipeline_with_data_parallel():
    cases = [("1f1b", 2, 1, 4, 2, 1), ("zb-h1", 3, 1, 3, 2, 2), ("gpipe", 2, 1, 2, 2, 3),
             ("interleaved-1f1b", 2, 2, 2, 2, 4),
             ("1f1b", 3, 1, 3, 3, 5, True), ("zb-h1", 4, 1, 4, 3, 6, True),
             ("interleaved-1f1b", 4, 2, 4, 2, 7, True)]
    res = run_distributed(_parity, 4, cases, 2, 2, timeout=240)
    for case, per_rank in zip(cases, zip(*res, strict=False), strict=False):
        errs = [e for e, _ in per_rank]
        assert worst(errs) < TOL, (case, errs)


def test_pipeline_bad_input():
    cases = [
        {"n": 5, "init": {"schedule": "1f1b", "micro_batches": 2}},
        {"n": 4, "n_blocks": 0, "init": {"schedule": "interleaved-1f1b", "micro_batches": 2,
                                          "virtual_stages": 2}},
        {"n": 4, "n_blocks": 3, "init": {"schedule": "interleaved-1f1b", "micro_batches": 2,
                                          "virtual_stages": 2}},
        {"n": 3, "init": {"schedule": "interleaved-1f1b", "micro_batches": 3,
                          "virtual_stages": 2}},
        {"n": 4, "init": {"schedule": "1f1b", "micro_batches": 2, "virtual_stages": 2}},
        {"n": 4, "init": {"schedule": "pipedream", "micro_batches": 2}},
    ]
    res = run_distributed(_errors, 2, [dict(c) for c in cases], 2, timeout=120)
    msgs = res[0]
    assert "--micro-batches=2" in msgs[0]
    assert "fewer than the 4 pipeline stages" in msgs[1]  # embedding + head over 2 x 2
    assert "interleaving" in msgs[2] and "--virtual-stages" in msgs[2]
    assert "multiple of pp=2" in msgs[3]
    assert "interleaved-1f1b" in msgs[4]
    assert "'pipedream'" in msgs[5]


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module, reentrant: bool):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


def _checkpointed_stages(schedule: str, reentrant: bool) -> float:
    from distllm import ParallelDims
    from distllm.parallel.pipeline import PipelineParallel

    dims, x, y = ParallelDims(tp=1, pp=2, dp=1), *make_batch(4, 0)
    layers = [_Checkpointed(m, reentrant) if isinstance(m, Block) else m for m in make_layers(2)]
    return PipelineParallel(layers, dims, schedule, 2).train_step(x, y, loss_fn)


@pytest.mark.parametrize("reentrant", [False, True])
def test_zero_bubble_names_checkpointing_inside_a_stage(reentrant):
    """zb-h1's B (one autograd.grad) cannot recompute a checkpointed layer's deferred linears:
    either of torch's checkpoint modes ends the job with one error naming the schedule; 1f1b
    runs the same stages."""
    from distllm.testing import DistributedFailure

    with pytest.raises(DistributedFailure, match="schedule='zb-h1' splits each backward"):
        run_distributed(_checkpointed_stages, 2, "zb-h1", reentrant, timeout=120)
    loss = run_distributed(_checkpointed_stages, 2, "1f1b", reentrant, timeout=120)[1]
    assert abs(loss - reference(2, *make_batch(4, 0))[0]) < TOL


@pytest.mark.parametrize("n_layers", [1])
def test_fewer_layers_than_stages(n_layers):
    from distllm.parallel.pipeline import split_layers

    with pytest.raises(ValueError, match="fewer than the 2 pipeline stages"):
        split_layers(n_layers, 2)
    with pytest.raises(ValueError, match="--virtual-stages"):
        split_layers(3, 2, virtual_stages=2)


class _Residual(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):  # (b, s, h) -> (b, s, h)
        return x + self.inner(x)


def _tp_layers(dims, n_blocks: int, parallel: bool):
    from distllm.nn import ColumnParallelLinear, ParallelMLP, VocabParallelEmbedding
    from distllm.nn.mlp import DenseMLP

    torch.manual_seed(0)
    dense = [nn.Embedding(12, HID)] + [_Residual(DenseMLP(HID, 4 * HID)) for _ in range(n_blocks)]
    dense = [m.double() for m in dense + [nn.Linear(HID, 12)]]
    if not parallel:
        return dense
    return ([VocabParallelEmbedding.from_dense(dense[0], dims)]
            + [_Residual(ParallelMLP.from_dense(b.inner, dims, overlap="none"))
               for b in dense[1:-1]]
            + [ColumnParallelLinear.from_dense(dense[-1], dims)])


def _tp_parity(cases):
    """pp=2 x tp=2: TP modules inside each stage; grads vs the dense model's, sharded."""
    from distllm import ParallelDims
    from distllm.nn import vocab_parallel_cross_entropy
    from distllm.parallel.data.grad_norm import clip_grad_norm_
    from distllm.parallel.pipeline import PipelineParallel

    dims = ParallelDims(tp=2, pp=2, dp=1)

    def tp_loss(logits, targets):  # (b, s, V/tp) local vocabulary slice
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), dims)

    errs = []
    for schedule, m, v, n, n_blocks in cases:
        pp = PipelineParallel(_tp_layers(dims, n_blocks, True), dims, schedule, m, v)
        g = torch.Generator().manual_seed(n)
        x, y = (torch.randint(0, 12, (n, SEQ), generator=g) for _ in range(2))
        loss = pp.train_step(x, y, tp_loss)
        ref = nn.Sequential(*_tp_layers(dims, n_blocks, False))
        ref_loss = nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        err = abs(loss - ref_loss.item())
        for c, ids in enumerate(pp.layer_ids):
            for layer, i in zip(pp.chunks[c], ids, strict=True):
                for p, q in zip(layer.parameters(), ref[i].parameters(), strict=True):
                    gq = q.grad
                    for d in range(gq.dim()):  # the dim TP split, if any
                        if p.shape[d] != gq.shape[d]:
                            gq = gq.chunk(dims.tp, d)[dims.tp_rank]
                    err = worst(err, float((p.grad - gq).abs().max()))
        norm = clip_grad_norm_(pp.parameters(), 1e30, dims=dims)  # over tp and pp
        ref_norm = torch.stack([q.grad.pow(2).sum() for q in ref.parameters()]).sum().sqrt()
        errs.append(worst(err, abs(float(norm) - float(ref_norm))))
    return errs


def test_pipeline_with_tensor_parallel_stages():
    cases = [("1f1b", 2, 1, 4, 2), ("zb-h1", 3, 1, 3, 2), ("interleaved-1f1b", 2, 2, 2, 2)]
    res = run_distributed(_tp_parity, 4, cases, timeout=240)
    for case, errs in zip(cases, zip(*res, strict=True), strict=True):
        assert worst(errs) < TOL, (case, errs)



class _Work:
    """A stand-in for a send's ``dist.Work``: completed or not, failed or not."""

    def __init__(self, done: bool, error: str | None = None):
        self.done, self.error, self.waited = done, error, False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        self.waited = True
        if self.error:
            raise RuntimeError(self.error)
        return True


def _drops_completed_sends() -> None:
    """Rank function (one rank: a StageComm needs a process group)."""
    from distllm.parallel.pipeline.pp_comm import StageComm

    comm = StageComm(0, None, torch.device("cpu"), 2)
    done, busy = _Work(True), _Work(False)
    sends = [(done, torch.ones(3), None), (busy, torch.ones(4), None),
             (done, torch.ones(5), None)]
    comm._sends = list(sends)
    comm.flush()  # gloo (this world's): its works are not asked, only waited for in finish
    assert comm._sends == sends and not done.waited
    comm._drops = True  # as on NCCL, or the dry run's fake backend
    comm.flush()
    assert [(w, t.numel()) for w, t, _ in comm._sends] == [(busy, 4)] and done.waited
    assert not busy.waited
    comm._sends.append((_Work(True, "send failed"), torch.ones(1), None))
    with pytest.raises(RuntimeError, match="send failed"):
        comm.flush()
    busy.done = True
    comm._sends = [(busy, torch.ones(4), None)]
    comm.finish()
    assert comm._sends == [] and busy.waited


def test_a_stage_drops_its_completed_sends_at_each_flush():
    """A send's tensor is dropped once ``is_completed`` says the send is done (NCCL: the
    kernel ran; the dry run's fake backend: at once), not kept to the end of the step;
    waited for then, so that a failed send raises. gloo's send works report completion only
    from ``wait``: there they are not asked at each flush, and stay until ``finish``."""
    run_distributed(_drops_completed_sends, 1)


def _held_at_step_end(schedule: str, m: int, v: int) -> list:
    """Rank function: the messages whose sends this rank still holds when a training step
    ends (before they are waited for)."""
    from distllm import ParallelDims
    from distllm.parallel.pipeline import PipelineParallel
    from distllm.parallel.pipeline.pp_comm import StageComm

    dims = ParallelDims(tp=1, pp=2, dp=1)
    pp = PipelineParallel(make_layers(6), dims, schedule, m, v, None, num_layers=8)
    held: list = []
    finish = StageComm.finish

    def spy(self):
        self.flush()  # as finish does first
        held.extend(sorted(k for _, _, k in self._sends if k is not None))
        return finish(self)

    x, y = make_batch(8, 0)
    StageComm.finish = spy
    try:
        pp.train_step(x if pp.is_first else None, y if pp.is_last else None, loss_fn)
    finally:
        StageComm.finish = finish
    return held


@pytest.mark.parametrize("schedule,m,v", [("1f1b", 4, 1), ("interleaved-1f1b", 4, 2)])
def test_gloo_drops_an_activations_send_when_its_gradient_returns(schedule, m, v):
    """gloo's send works report completion only through wait: an activation's send is
    dropped when the stage it went to sends back that micro-batch's gradient (it consumed
    the activation), not held to the step's end; the gradients' sends are."""
    held = run_distributed(_held_at_step_end, 2, schedule, m, v, timeout=240)
    # what stays: the gradients each rank sent, to the chunks before its own (rank 0 holds
    # chunks 0 and 2 when interleaved, rank 1 chunks 1 and 3)
    to = [[], [0]] if v == 1 else [[1], [0, 2]]
    assert held == [sorted(("B", mb, c) for c in cs for mb in range(m)) for cs in to], held



def _one_rank_checks() -> dict:
    from distllm import ParallelDims
    from distllm.parallel import DistributedDataParallel
    from distllm.parallel.pipeline import PipelineParallel

    dims, out = ParallelDims(tp=1, pp=1, dp=1), {}
    # a DDP given as grad_sync holds the same chunks: a reference, not a child module
    pipe = PipelineParallel(make_layers(2), dims, "1f1b", 2)
    keys = list(pipe.state_dict())
    pipe.grad_sync = DistributedDataParallel(pipe.chunks, dims=dims)
    out["keys"] = (list(pipe.state_dict()) == keys, [n for n, _ in pipe.named_children()])
    fresh = PipelineParallel(make_layers(2, seed=1), dims, "1f1b", 2)
    fresh.load_state_dict(pipe.state_dict())
    out["loaded"] = all(torch.equal(a, b) for a, b in
                        zip(fresh.parameters(), pipe.parameters(), strict=True))
    # the last stage's saved bytes include the loss's (cross-entropy keeps its log-softmax):
    # what the layers and then the loss save for backward, counted here the same way
    x, y = make_batch(4, 0)
    pipe = PipelineParallel(make_layers(1), dims, "1f1b", 1, track_memory=True)
    pipe.train_step(x, y, loss_fn)
    layers = make_layers(1)
    params = {p.untyped_storage().data_ptr() for layer in layers for p in layer.parameters()}
    seen, saved = set(), []

    def pack(t):
        key = (t.untyped_storage().data_ptr(), tuple(t.shape))
        if key[0] not in params and key not in seen:
            seen.add(key)
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = nn.Sequential(*layers)(x)
        model_only = sum(saved)
        loss_fn(logits, y)
    out["bytes"] = (pipe.last_stats.peak_activation_bytes, sum(saved), model_only)
    # eval_step's micro_batches: a positive integer, named where it does not divide the batch
    for bad in (-1, 0, 2.5, True):
        try:
            pipe.eval_step(x, y, loss_fn, micro_batches=bad)
            out[("eval", bad)] = "no error"
        except ValueError as e:
            out[("eval", bad)] = str(e)
    try:
        pipe.eval_step(x, y, loss_fn, micro_batches=3)
    except ValueError as e:
        out["eval_split"] = str(e)
    return out


def test_one_rank_pipeline_state_memory_and_eval_arguments():
    r = run_distributed(_one_rank_checks, 1, timeout=120)[0]
    assert r["keys"] == (True, ["chunks"]) and r["loaded"]
    got, want, model_only = r["bytes"]
    assert got == want > model_only, r["bytes"]
    for bad in (-1, 0, 2.5, True):
        assert r[("eval", bad)] == (f"eval_step: micro_batches={bad!r}: give a positive "
                                    f"integer, or None for the training's 1")
    assert r["eval_split"] == ("the batch has 4 samples, not divisible by eval_step's "
                               "micro_batches=3: choose eval_step's micro_batches in [1, 2, 4], "
                               "or a batch size divisible by 3")
