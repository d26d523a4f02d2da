"""The single-process run that the parity matrix compares every layout with is itself right.

Every layout's parity test compares with distllm's own one-process run: a defect there (a
parameter in the wrong weight-decay group, clipping by the wrong norm, the schedule a step
late) would move the reference and every layout alike, and no parity test would see it.
Here the trainer's one-process run, float64 with the default optimizer settings, is compared
with a loop written from torch's and transformers' parts alone: Hugging Face's GPT-2 (the
model distllm's GPT is checked against in ``test_hf``), ``torch.optim.AdamW`` (not fused)
with its two groups named here, ``torch.nn.utils.clip_grad_norm_``, and the schedule's
formula written out. Both start from one saved GPT-2 and read the same batches.
"""

from __future__ import annotations

import json
import math

from distllm.testing import run_distributed

STEPS, HORIZON = 4, 40  # a 40-step schedule: 2 warm-up steps, then the cosine decay
TOL = 1e-12  # losses and gradient norms, relative
WTOL = 1e-10  # the last weights, absolute (they are about 0.02 to 1)


def _save_untied_gpt2(path) -> None:
    """A random GPT-2 of the ``tiny`` preset's shape, its head untied from the embedding (as
    the ``tiny`` preset's), without dropout (distllm's GPT has none)."""
    from tests.train._util import save_tiny_gpt2

    save_tiny_gpt2(path, seed=5, tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0,
                   attn_pdrop=0.0)


def _train(corpus: str, out: str, hf_dir: str) -> list[float]:
    """Rank function: the trainer's defaults in float64, started from ``hf_dir``."""
    from distllm.train.trainer import train
    from tests.train._util import make_cfg

    res = train(make_cfg(corpus, out, steps=HORIZON, stop_after=STEPS, save_final=True,
                         init_from=hf_dir))
    return res.losses


def _lr(step: int) -> float:
    """The default schedule of a 40-step run, written out: peak 3e-3, warm-up 5% of the steps
    (2), then cosine to 0.1 of the peak at the last step (39)."""
    peak, low, warm = 3e-3, 3e-4, 2
    if step < warm:
        return peak * (step + 1) / warm
    return low + 0.5 * (peak - low) * (1 + math.cos(math.pi * (step - warm) / (HORIZON - 1 - warm)))


def _hand_loop(corpus: str, hf_dir: str):
    """(losses, gradient norms, the model after the last step) of the loop from torch parts."""
    import torch
    import torch.nn.functional as F
    from transformers import GPT2LMHeadModel

    from distllm.train.data import BatchLoader, load_corpus

    hf = GPT2LMHeadModel.from_pretrained(hf_dir).double().train()
    named = dict(hf.named_parameters())
    # decoupled weight decay on the embedding, the head and the blocks' four matrices; none
    # on the position embedding, the norms and the biases
    matrices = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                "mlp.c_proj.weight")
    decay = {n for n in named
             if n in ("transformer.wte.weight", "lm_head.weight") or n.endswith(matrices)}
    assert len(decay) == 2 + 4 * 4 and len(named) - len(decay) == 1 + 4 * 8 + 2
    groups = [{"params": [named[n] for n in sorted(decay)], "weight_decay": 0.1},
              {"params": [p for n, p in named.items() if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=_lr(0), betas=(0.9, 0.95), eps=1e-8, foreach=False)
    loader = BatchLoader(load_corpus(corpus).train, seq_len=32, global_batch=8, seed=7)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = loader.next()
        for g in opt.param_groups:
            g["lr"] = _lr(step)
        loss = F.cross_entropy(hf(x).logits.reshape(-1, 256), y.reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, norms, hf


def test_the_trainer_is_a_loop_of_torch_parts(corpus, tmp_path):

    from distllm.models.config import PRESETS
    from distllm.models.hf import _canonical_from_hf
    from distllm.train.checkpoint import read_layers

    hf_dir, out = tmp_path / "hf", tmp_path / "run"
    _save_untied_gpt2(hf_dir)
    got = run_distributed(_train, 1, corpus, str(out), str(hf_dir), timeout=300)[0]
    want, norms, hf = _hand_loop(corpus, str(hf_dir))
    # the defaults are all at work: clipping on every step, a schedule that moves
    assert min(norms) > 1.0, norms
    lrs = [_lr(s) for s in range(STEPS)]
    assert lrs[0] < lrs[1] and lrs[-1] < lrs[-2], lrs  # warm-up and decay both compared
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= TOL * abs(b), f"step {step + 1}: loss {a} vs {b}"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [m["grad_norm"] for m in metrics if "grad_norm" in m]
    assert len(trained) == STEPS
    for step, (a, b) in enumerate(zip(trained, norms, strict=True)):
        assert abs(a - b) <= TOL * b, f"step {step + 1}: gradient norm {a} vs {b}"
    # the last update too: every weight, against the hand loop's after its last step
    from transformers import GPT2LMHeadModel

    _, last, _ = read_layers(out / "checkpoints" / f"step_{STEPS:08d}")
    cfg = PRESETS["tiny"]
    ends = {"hand loop": hf.state_dict(),
            "start": GPT2LMHeadModel.from_pretrained(hf_dir).double().state_dict()}
    assert sorted(last) == list(range(cfg.n_layers + 2))
    moved = 0.0
    for i, layer in last.items():
        ref, start = (_canonical_from_hf(ends[k], cfg, i) for k in ("hand loop", "start"))
        assert layer.keys() == ref.keys(), i
        for name, t in layer.items():
            err = float((t.double() - ref[name]).abs().max())
            assert err <= WTOL, f"layer {i} {name}: {err:.3g} from the hand loop's"
            moved = max(moved, float((t.double() - start[name]).abs().max()))
    assert moved > 1e-3  # the weights compared had moved from where both started
