"""Hugging Face GPT-2 conversion: ``from_hf`` at tp2.pp2 gives HF's logits and loss
(float64), and ``to_hf`` gives back HF's weights, with the vocabulary split over TP and held
whole. The vocabulary (123) is odd so that its padding to a multiple of 64*tp and the
masking of the padded logits are exercised."""

from __future__ import annotations

import json
import re

import pytest

from distllm.testing import run_distributed
from tests._errors import worst

TOL = 1e-10  # float64; only the summation order of the TP all-reduces differs


def _hf_rank(vocab: int, seq: int, vocab_parallel: str) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    from distllm import ParallelDims
    from distllm.models import from_hf, to_hf
    from distllm.parallel.tensor.mappings import all_gather_dim
    from distllm.train.engine import stage_layer_ids

    torch.manual_seed(0)  # the same random HF model on every rank
    cfg = GPT2Config(vocab_size=vocab, n_positions=40, n_embd=64, n_layer=3, n_head=4,
                     activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    hf = GPT2LMHeadModel(cfg).double().eval()
    with torch.no_grad():  # non-trivial LayerNorm and bias values
        for name, p in hf.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    x = torch.randint(0, vocab, (3, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(x)
        # HF's own loss upcasts to float32; the float64 reference is computed here
        ref_loss = torch.nn.functional.cross_entropy(ref.logits[:, :-1].reshape(-1, vocab),
                                                     x[:, 1:].reshape(-1))
    dims = ParallelDims(tp=2, pp=2)
    ids = stage_layer_ids(cfg.n_layer + 2, 2, 1, dims.pp_rank)[0]
    model = from_hf(hf, dims, layer_ids=ids, vocab_parallel=vocab_parallel).eval()
    assert model.vocab_parallel == (vocab_parallel == "on")
    out: dict[str, float] = {}
    with torch.no_grad():
        if dims.is_first_stage:
            dist.send(model(x).contiguous(), dims.next_pp_rank)
        else:
            h = torch.empty(3, seq, 64, dtype=torch.float64)
            dist.recv(h, dims.prev_pp_rank)
            local = model(h)  # (b, s, V_pad/tp); whole: (b, s, V)
            full = (all_gather_dim(local, -1, dims.tp_group)[..., :vocab]
                    if model.vocab_parallel else local)
            out["logits"] = float((full - ref.logits).abs().max())
            loss = model.loss(local[:, :-1], x[:, 1:])
            out["loss"] = abs(float(loss) - float(ref_loss))
    converted = to_hf(model)
    # no <|endoftext|> id (50256) outside a 123-token vocabulary
    out["special_ids_in_vocab"] = float(all(
        t is None or t < vocab for t in (converted.config.bos_token_id,
                                          converted.config.eos_token_id)))
    back = converted.state_dict()
    want = hf.state_dict()
    want["lm_head.weight"] = want["transformer.wte.weight"]
    out["to_hf"] = worst(float((back[k] - want[k]).abs().max()) for k in want
                       if not k.endswith(("attn.bias", "masked_bias")))
    return out


@pytest.mark.parametrize("vocab_parallel", ["on", "off"])
def test_from_hf_tp2_pp2(vocab_parallel):
    res = run_distributed(_hf_rank, 4, 123, 7, vocab_parallel, timeout=300)
    last = [r for r in res if "logits" in r]
    assert len(last) == 2  # the two TP ranks of the last stage
    for r in last:
        assert r["logits"] < TOL and r["loss"] < TOL, r
    for r in res:
        assert r["to_hf"] == 0.0 and r["special_ids_in_vocab"] == 1.0, r


@pytest.mark.parametrize("option, value, want", [
    ("scale_attn_weights", False, "scale_attn_weights=False of the GPT-2 config is not "
     "supported: distllm's GPT computes the model of scale_attn_weights=True"),
    ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx=True of the "
     "GPT-2 config is not supported: distllm's GPT computes the model of "
     "scale_attn_by_inverse_layer_idx=False"),
    ("add_cross_attention", True, "add_cross_attention=True of the GPT-2 config is not "
     "supported: distllm's GPT computes the model of add_cross_attention=False"),
])
def test_config_from_hf_refuses_other_attention(option, value, want):
    """GPT-2 options that change the logits are refused by name (no processes)."""
    from transformers import GPT2Config

    from distllm.models.hf import config_from_hf

    cfg = GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    assert config_from_hf(cfg).hidden_size == 32  # the defaults are distllm's model
    setattr(cfg, option, value)
    with pytest.raises(ValueError) as e:
        config_from_hf(cfg)
    assert str(e.value) == want


def _reordered_rank() -> float:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from distllm import ParallelDims
    from distllm.models import from_hf

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0, reorder_and_upcast_attn=True,
                     attn_implementation="eager")
    hf = GPT2LMHeadModel(cfg).eval()  # float32: the upcast path's own precision
    with torch.no_grad():  # sharper attention than the 0.02 init
        for blk in hf.transformer.h:
            blk.attn.c_attn.weight.mul_(10)
    x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    model = from_hf(hf, ParallelDims(tp=1, pp=1)).eval()
    with torch.no_grad():
        return float((model(x)[..., :50] - hf(x).logits).abs().max())


def test_from_hf_accepts_reorder_and_upcast_attn():
    """``reorder_and_upcast_attn`` (float32 scores on HF's eager path) is the same model:
    HF's logits to float32 rounding."""
    err = run_distributed(_reordered_rank, 1, timeout=120)[0]
    assert err < 1e-5, err  # float32, logits of order 1: rounding of two summation orders


# --- --init-from: a fresh run starts from a Hugging Face GPT-2 folder ----------------------

def _save_tiny_hf(path) -> None:
    """A random GPT-2 of the ``tiny`` preset's shape, saved as ``save_pretrained`` writes it."""
    from tests.train._util import save_tiny_gpt2

    save_tiny_gpt2(path)


def _first_loss(corpus: str, out: str, hf_dir: str) -> float:
    """Rank function: the first step's loss of a tp2.pp2 float64 run from ``hf_dir``."""
    from distllm.train.trainer import train
    from tests.train._util import make_cfg

    res = train(make_cfg(corpus, out, tp=2, pp=2, m=2, steps=60, stop_after=1,
                         init_from=hf_dir))
    return res.losses[0]


def test_init_from_starts_at_the_hf_models_loss(corpus, tmp_path):
    """The first step's loss of tp2.pp2 (float64) started from a saved HF GPT-2 is HF's own
    loss on that batch: every layer's weights came over, sharded."""
    import torch
    from transformers import GPT2LMHeadModel

    from distllm.train.data import BatchLoader, load_corpus

    _save_tiny_hf(tmp_path / "hf")
    losses = run_distributed(_first_loss, 4, corpus, str(tmp_path / "run"),
                             str(tmp_path / "hf"), timeout=300)
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").double().eval()
    x, y = BatchLoader(load_corpus(corpus).train, seq_len=32, global_batch=8, seed=7).next()
    with torch.no_grad():
        logits = hf(x).logits
        want = float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)))
    assert all(abs(got - want) < TOL for got in losses), (losses, want)


def _masters_from_hf(corpus: str, out: str, hf_dir: str, layout: dict) -> float:
    """Rank function: an engine of ``layout`` in bf16 built with ``--init-from``; the largest
    difference between its canonical weights (the fp32 masters: this rank's boxes of them, as
    a checkpoint saves them) and the folder's."""
    import torch
    from transformers import GPT2LMHeadModel

    from distllm import ParallelDims
    from distllm.models.hf import _canonical_from_hf, config_from_hf
    from distllm.train.checkpoint_state import own_pieces
    from distllm.train.engine import Engine
    from tests.train._util import make_cfg

    cfg = make_cfg(corpus, out, dtype="bfloat16", init_from=hf_dir, **layout)
    engine = Engine(cfg, cfg.model_config(), ParallelDims.from_layout(cfg.parallel))
    pieces, _ = own_pieces(engine)
    hf = GPT2LMHeadModel.from_pretrained(hf_dir)
    sd, hcfg = hf.state_dict(), config_from_hf(hf.config)
    diff = 0.0
    assert pieces
    for key, (_, boxes) in pieces.items():
        i, name = key.removeprefix("model.layers.").split(".", 1)
        want = _canonical_from_hf(sd, hcfg, int(i))[name]
        for off, got in boxes:
            assert got.dtype == torch.float32, key
            where = tuple(slice(o, o + n) for o, n in zip(off, got.shape, strict=True))
            diff = worst(diff, float((got - want[where]).abs().max()))
    return diff


@pytest.mark.parametrize("layout", [dict(dp=2, zero=1), dict(tp=2, dp=2, zero=3)],
                         ids=["dp2.zero1", "tp2.dp2.zero3"])
def test_init_from_sets_bf16_masters_exactly(corpus, tmp_path, layout):
    """bf16 with fp32 masters: the masters are the folder's fp32 weights, not their bf16
    rounding (2^-9 off)."""
    _save_tiny_hf(tmp_path / "hf")
    world = 2 if "tp" not in layout else 4
    diffs = run_distributed(_masters_from_hf, world, corpus, str(tmp_path / "run"),
                            str(tmp_path / "hf"), layout, timeout=300)
    assert diffs == [0.0] * world, diffs


def test_init_from_refuses_weights_under_other_names(tmp_path):
    """A folder whose tensors carry other names (a prefix, as torch.compile's ``_orig_mod.``)
    would load as random weights in transformers (a warning only): refused, naming them."""
    from safetensors.torch import load_file, save_file

    from distllm.models.config import GPTConfig
    from distllm.models.hf import pretrained_layers

    _save_tiny_hf(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    save_file({f"_orig_mod.{k}": v for k, v in load_file(f).items()}, f,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"--init-from .*: its weights are not GPT-2's as "
                                         r"transformers names them \(missing keys: .* and \d+ "
                                         r"more; unexpected keys: _orig_mod\."):
        pretrained_layers(str(tmp_path / "hf"), GPTConfig.preset("tiny"), "tiny")


def _canonical_layers(hf_dir) -> dict[int, dict]:
    """Every layer's canonical tensors of a folder, through transformers' own loading."""
    from transformers import GPT2LMHeadModel

    from distllm.models.hf import _canonical_from_hf, config_from_hf

    hf = GPT2LMHeadModel.from_pretrained(hf_dir)
    cfg = config_from_hf(hf.config)
    return {i: _canonical_from_hf(hf.state_dict(), cfg, i) for i in range(cfg.n_layers + 2)}


def _variant(src, dst, kind: str) -> None:
    """The folder ``src`` written another way a Hugging Face GPT-2 folder may be: its
    tensors under ``GPT2Model``'s names with the attention-mask buffers (as the original
    ``gpt2`` checkpoint), as safetensors shards with an index, or as ``pytorch_model.bin``."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    if kind == "bare":
        bare = {k.removeprefix("transformer."): v for k, v in sd.items()}
        bare |= {f"h.{i}.attn.bias": torch.ones(1, 1, 128, 128).tril() for i in range(4)}
        save_file(bare, dst / "model.safetensors", metadata={"format": "pt"})
    elif kind == "shards":
        names = sorted(sd)
        parts = {"model-00001-of-00002.safetensors": names[::2],
                 "model-00002-of-00002.safetensors": names[1::2]}
        for f, keys in parts.items():
            save_file({k: sd[k] for k in keys}, dst / f, metadata={"format": "pt"})
        (dst / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}))
    elif kind == "bin":
        torch.save(sd, dst / "pytorch_model.bin")
    else:  # torch.save's format before torch 1.6, which cannot be memory-mapped
        torch.save(sd, dst / "pytorch_model.bin", _use_new_zipfile_serialization=False)


@pytest.mark.parametrize("kind", ["bare", "shards", "bin", "legacy-bin"])
def test_init_from_reads_every_way_a_folder_holds_its_weights(tmp_path, kind):
    import torch

    from distllm.models.config import GPTConfig
    from distllm.models.hf import pretrained_layers

    _save_tiny_hf(tmp_path / "hf")
    want = _canonical_layers(tmp_path / "hf")
    _variant(tmp_path / "hf", tmp_path / kind, kind)
    layers = pretrained_layers(str(tmp_path / kind), GPTConfig.preset("tiny"), "tiny")
    for i, tensors in want.items():
        got = layers(i)
        assert sorted(got) == sorted(tensors)
        for name, t in tensors.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), (kind, i, name)


def test_init_from_reads_a_layer_when_it_is_asked_for(tmp_path, monkeypatch):
    """A pipeline rank reads its own layers' tensors, not the model's."""
    from distllm.models import hf as hf_mod
    from distllm.models.config import GPTConfig

    _save_tiny_hf(tmp_path / "hf")
    read, real = [], hf_mod._FolderWeights.__getitem__
    monkeypatch.setattr(hf_mod._FolderWeights, "__getitem__",
                        lambda self, name: read.append(name) or real(self, name))
    layers = hf_mod.pretrained_layers(str(tmp_path / "hf"), GPTConfig.preset("tiny"), "tiny")
    assert read == []
    layers(2)
    assert read and all(name.startswith("transformer.h.1.") for name in read), read
    read.clear()  # the last stage of a folder with its own head reads the head, not wte
    _untie(tmp_path / "hf")
    hf_mod.pretrained_layers(str(tmp_path / "hf"), GPTConfig.preset("tiny"), "tiny")(5)
    assert sorted(read) == ["lm_head.weight", "transformer.ln_f.bias",
                            "transformer.ln_f.weight"], read


def _untie(hf_dir) -> None:
    """The folder's head its own (``tie_word_embeddings`` false), one more than its
    embedding."""
    import json

    from safetensors.torch import load_file, save_file

    f = hf_dir / "model.safetensors"
    sd = load_file(f)
    save_file(sd | {"lm_head.weight": sd["transformer.wte.weight"] + 1}, f,
              metadata={"format": "pt"})
    conf = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(conf | {"tie_word_embeddings": False}))


def test_init_from_reads_the_head_as_transformers_does(tmp_path):
    """An untied folder (``tie_word_embeddings`` false) without ``lm_head.weight`` was taken,
    its embedding silently the head (transformers leaves that head at random, "MISSING"): it
    is refused. A tied folder's head is the ``lm_head.weight`` its files hold (transformers
    does not tie two different tensors), else its embedding."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GPT2LMHeadModel

    from distllm.models.config import GPTConfig
    from distllm.models.hf import pretrained_layers

    hf_dir = tmp_path / "hf"
    _save_tiny_hf(hf_dir)
    _untie(hf_dir)
    tiny = GPTConfig.preset("tiny")
    theirs = GPT2LMHeadModel.from_pretrained(hf_dir)
    head = pretrained_layers(str(hf_dir), tiny, "tiny")(5)["lm_head.weight"]
    assert torch.equal(head, theirs.lm_head.weight)
    f = hf_dir / "model.safetensors"
    sd = load_file(f)
    save_file({k: v for k, v in sd.items() if k != "lm_head.weight"}, f,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"its weights are not GPT-2's as transformers names "
                                         r"them \(missing keys: lm_head\.weight\)"):
        pretrained_layers(str(hf_dir), tiny, "tiny")
    save_file(sd, f, metadata={"format": "pt"})  # its own head, in a folder that ties it
    conf = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(conf | {"tie_word_embeddings": True}))
    theirs = GPT2LMHeadModel.from_pretrained(hf_dir)
    head = pretrained_layers(str(hf_dir), tiny, "tiny")(5)["lm_head.weight"]
    assert torch.equal(head, theirs.lm_head.weight)
    save_file({k: v for k, v in sd.items() if k != "lm_head.weight"}, f,
              metadata={"format": "pt"})  # tied, held once
    head = pretrained_layers(str(hf_dir), tiny, "tiny")(5)["lm_head.weight"]
    assert torch.equal(head, GPT2LMHeadModel.from_pretrained(hf_dir).lm_head.weight)
    assert torch.equal(head, sd["transformer.wte.weight"])


def test_init_from_refuses_a_weight_of_another_shape_or_none(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from distllm.models.config import GPTConfig
    from distllm.models.hf import pretrained_layers

    _save_tiny_hf(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    sd = load_file(f)
    sd["transformer.h.2.mlp.c_fc.bias"] = sd["transformer.h.2.mlp.c_fc.bias"][:500]
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"its weights are not GPT-2's as transformers names "
                                         r"them \(mismatched keys: transformer\.h\.2\.mlp\.c_fc"
                                         r"\.bias \(500,\) \(not \(512,\)\)\)"):
        pretrained_layers(str(tmp_path / "hf"), GPTConfig.preset("tiny"), "tiny")
    f.write_bytes(b"\xff" * 64)  # damaged: one line naming --init-from, no traceback
    with pytest.raises(ValueError, match=r"--init-from .*: its weights cannot be read \("):
        pretrained_layers(str(tmp_path / "hf"), GPTConfig.preset("tiny"), "tiny")
    f.unlink()
    with pytest.raises(ValueError, match=r"--init-from .*: no weights there \(model\."
                                         r"safetensors, pytorch_model\.bin, or an index of "
                                         r"their shards\)"):
        pretrained_layers(str(tmp_path / "hf"), GPTConfig.preset("tiny"), "tiny")
    # a pickle of more than tensors: refused, without torch's advice to load it unsafely
    import os

    torch.save({"x": os.getcwd}, tmp_path / "hf" / "pytorch_model.bin")
    with pytest.raises(ValueError) as e:
        pretrained_layers(str(tmp_path / "hf"), GPTConfig.preset("tiny"), "tiny")
    assert str(e.value) == (f"--init-from {tmp_path / 'hf'}: its weights cannot be read (not a "
                            f"file of tensors that torch.load reads safely)")


@pytest.mark.parametrize(("field", "value"), [
    ("n_layer", "4"), ("n_inner", 512.0), ("layer_norm_epsilon", "1e-5")])
def test_init_from_refuses_a_config_field_of_the_wrong_type_in_one_line(capsys, tmp_path,
                                                                         field, value):
    """transformers 5 checks each config field's type, raising huggingface_hub's
    StrictDataclassFieldValidationError (neither ValueError nor OSError): ``distllm train
    --init-from`` stopped with its traceback. (An older transformers takes the value, which
    GPTConfig then refuses.)"""
    import transformers

    from distllm.cli import main

    hf = tmp_path / "hf"
    _save_tiny_hf(hf)
    conf = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(conf | {field: value}))
    capsys.readouterr()  # transformers' progress bar of the save
    assert main(["train", "--model", "tiny", "--init-from", str(hf)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"distllm train: error: --init-from {hf}: "), err
    assert repr(value) in err[0], err
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert f"{hf}: config.json: Validation error for field '{field}': TypeError: " in err[0]


def test_init_from_refuses_another_model_type(tmp_path):
    """A Llama folder of the tiny preset's shape was read as a GPT-2 config (transformers
    warns only), and refused only at the weight check; an in-memory config of another model
    gave an AttributeError."""
    from transformers import LlamaConfig

    from distllm.models.hf import config_from_hf, pretrained_config

    llama = LlamaConfig(vocab_size=256, hidden_size=128, num_hidden_layers=4,
                        num_attention_heads=4, intermediate_size=512, max_position_embeddings=128)
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError) as e:
        pretrained_config(str(tmp_path / "llama"))
    assert str(e.value) == (f"--init-from {tmp_path / 'llama'}: config.json: model_type='llama', "
                            f"not 'gpt2': distllm reads GPT-2 models; pass a folder "
                            f"GPT2LMHeadModel.save_pretrained wrote")
    with pytest.raises(ValueError, match=r"^model_type='llama', not 'gpt2': distllm reads "
                                         r"GPT-2 models \(GPT2Config, GPT2LMHeadModel\)$"):
        config_from_hf(llama)
    _save_tiny_hf(tmp_path / "hf")  # GPT-2's, and one whose config.json names no model type
    assert pretrained_config(str(tmp_path / "hf")).n_layers == 4
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    del conf["model_type"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(conf))
    assert pretrained_config(str(tmp_path / "hf")).n_layers == 4


def test_from_hf_refuses_a_model_without_an_lm_head_and_bad_layer_ids():
    """A GPT2Model (keys without ``transformer.``, no head) gave a bare KeyError; layer ids
    out of range or repeated were taken (one past the head built an extra block)."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    from distllm import ParallelDims
    from distllm.models import from_hf

    cfg = GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                     bos_token_id=0, eos_token_id=0)
    dims = ParallelDims(tp=1, pp=1, dp=1)
    with pytest.raises(ValueError) as e:
        from_hf(GPT2Model(cfg), dims)
    assert str(e.value) == ("from_hf: hf_model is a GPT2Model, whose weights have no "
                            "transformer.wte.weight or lm_head.weight: pass a GPT2LMHeadModel "
                            "(e.g. GPT2LMHeadModel.from_pretrained of its folder)")
    hf = GPT2LMHeadModel(cfg)
    for ids, says in (([0, 1, 2, 3, 4], "layer_ids=[0, 1, 2, 3, 4]: 4 out of range"),
                      ([1, 1], "layer_ids=[1, 1]: give each layer once, in increasing order")):
        with pytest.raises(ValueError, match=re.escape(says)):
            from_hf(hf, dims, layer_ids=ids)
    assert from_hf(hf, dims, layer_ids=[2, 3]).layer_ids == [2, 3]


@pytest.mark.parametrize("index, words", [
    ('{"metadata": {},\n', "model.safetensors.index.json is not valid JSON (Expecting "),
    ('["a list"]', "model.safetensors.index.json has no weight_map"),
    ('{"weight_map": {"wte.weight": 3}}', "model.safetensors.index.json has no weight_map"),
])
def test_init_from_a_garbled_shard_index_is_one_line_naming_it(tmp_path, index, words):
    """A cut-short index was json's own message ("Expecting property name ..."), naming no
    file or flag; a list, or a weight_map of numbers, a traceback."""
    from distllm.models.config import GPTConfig
    from distllm.models.hf import pretrained_layers

    _save_tiny_hf(tmp_path / "hf")
    _variant(tmp_path / "hf", tmp_path / "shards", "shards")
    (tmp_path / "shards" / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError) as e:
        pretrained_layers(str(tmp_path / "shards"), GPTConfig.preset("tiny"), "tiny")
    assert str(e.value).startswith(f"--init-from {tmp_path / 'shards'}: {words}"), e.value
    assert str(e.value).endswith("pass a folder GPT2LMHeadModel.save_pretrained wrote")
