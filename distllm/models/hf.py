"""Conversion between Hugging Face ``GPT2LMHeadModel`` and the sharded distllm :class:`GPT`.

Hugging Face's GPT-2 stores its projections as ``Conv1D`` with weights ``(in, out)``; the
canonical distllm tensors are ``nn.Linear``-shaped ``(out, in)``, so every projection is
transposed. The fused ``c_attn`` columns are ``[q | k | v]`` with heads contiguous, the same
order as the canonical QKV rows. The head is untied in distllm (the embedding and the head may
sit on different pipeline stages): ``from_hf`` copies ``wte`` into it.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from distllm.models.config import GPTConfig
from distllm.models.gpt import GPT
from distllm.models.sharding import gather_layer, load_layer
from distllm.parallel.mesh import ParallelDims

__all__ = ["from_hf", "to_hf", "hf_from_layers", "config_from_hf", "pretrained_config",
           "check_pretrained_shape", "pretrained_layers", "quiet_transformers"]

_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


# GPT-2 options that change the function the model computes, with the value distllm's GPT
# implements: attention scores scaled by 1/sqrt(head_dim) in every layer, no cross-attention
_FIXED = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
          "add_cross_attention": False}


def config_from_hf(hf_config) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face ``GPT2Config``; a ``ValueError`` naming the
    option for a config distllm's GPT does not compute (a ``model_type`` other than
    ``gpt2``, an activation other than ``gelu_new``, ``gelu_pytorch_tanh`` and ``gelu``,
    attention scores not scaled by 1/sqrt(head_dim) or scaled by the inverse layer index,
    cross-attention layers).
    ``reorder_and_upcast_attn`` is accepted: it computes the same scores, in float32 (on HF's
    eager attention path only), so it changes rounding, not the function; distllm's
    attention computes in the model's dtype."""
    kind = getattr(hf_config, "model_type", "gpt2")
    if kind != "gpt2":
        raise ValueError(f"model_type={kind!r}, not 'gpt2': distllm reads GPT-2 models "
                         f"(GPT2Config, GPT2LMHeadModel)")
    act = hf_config.activation_function
    if act not in _ACT:
        raise ValueError(f"activation_function={act!r} of the GPT-2 config is not supported: "
                         f"use one of {', '.join(_ACT)}")
    for name, ours in _FIXED.items():
        theirs = getattr(hf_config, name, ours)
        if bool(theirs) != ours:
            raise ValueError(f"{name}={theirs!r} of the GPT-2 config is not supported: distllm's "
                             f"GPT computes the model of {name}={ours!r}")
    h = hf_config.n_embd
    return GPTConfig(vocab_size=hf_config.vocab_size, n_layers=hf_config.n_layer, hidden_size=h,
                     n_heads=hf_config.n_head, ffn_hidden_size=hf_config.n_inner or 4 * h,
                     max_seq_len=hf_config.n_positions, activation=_ACT[act],
                     layer_norm_eps=hf_config.layer_norm_epsilon, tie_embeddings=False,
                     name="hf-gpt2")


def _canonical_from_hf(sd: dict[str, torch.Tensor], cfg: GPTConfig, i: int
                       ) -> dict[str, torch.Tensor]:
    """Layer ``i``'s canonical tensors from GPT-2's ``sd``: the head is ``lm_head.weight``
    where there is one (transformers does not tie two different tensors), else the token
    embedding (a tied model's files may hold it once)."""
    if i == 0:
        return {"wte.weight": sd["transformer.wte.weight"], "wpe": sd["transformer.wpe.weight"]}
    if i == cfg.n_layers + 1:
        head = sd["lm_head.weight" if "lm_head.weight" in sd else "transformer.wte.weight"]
        return {"ln_f.weight": sd["transformer.ln_f.weight"],
                "ln_f.bias": sd["transformer.ln_f.bias"], "lm_head.weight": head}
    p = f"transformer.h.{i - 1}."
    t = lambda k: sd[p + k].t()  # Conv1D (in, out) -> Linear (out, in)
    return {
        "ln_1.weight": sd[p + "ln_1.weight"], "ln_1.bias": sd[p + "ln_1.bias"],
        "attn.qkv.weight": t("attn.c_attn.weight"), "attn.qkv.bias": sd[p + "attn.c_attn.bias"],
        "attn.proj.weight": t("attn.c_proj.weight"), "attn.proj.bias": sd[p + "attn.c_proj.bias"],
        "ln_2.weight": sd[p + "ln_2.weight"], "ln_2.bias": sd[p + "ln_2.bias"],
        "mlp.fc.weight": t("mlp.c_fc.weight"), "mlp.fc.bias": sd[p + "mlp.c_fc.bias"],
        "mlp.proj.weight": t("mlp.c_proj.weight"), "mlp.proj.bias": sd[p + "mlp.c_proj.bias"],
    }


@torch.no_grad()
def from_hf(hf_model, dims: ParallelDims, *, layer_ids: Iterable[int] | None = None,
            dtype: torch.dtype | None = None, **gpt_kwargs) -> GPT:
    """A :class:`GPT` holding ``layer_ids`` (default: all; else each once, in increasing
    order, see :func:`~distllm.models.gpt.check_layer_ids`) of the ``GPT2LMHeadModel``
    ``hf_model``, sharded over ``dims``' TP group; a ValueError naming GPT2LMHeadModel for a
    ``GPT2Model`` (no LM head) or another GPT-2 model. ``gpt_kwargs`` go to :class:`GPT`
    (``sequence_parallel``, ``overlap``...). No collective."""
    cfg = config_from_hf(hf_model.config)
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    if missing := [k for k in ("transformer.wte.weight", "lm_head.weight") if k not in sd]:
        raise ValueError(f"from_hf: hf_model is a {type(hf_model).__name__}, whose weights "
                         f"have no {' or '.join(missing)}: pass a GPT2LMHeadModel (e.g. "
                         f"GPT2LMHeadModel.from_pretrained of its folder)")
    dtype = dtype or next(iter(sd.values())).dtype
    model = GPT(cfg, dims, layer_ids=layer_ids, dtype=dtype, seed=None, **gpt_kwargs)
    for i in model.layer_ids:
        load_layer(model, i, {k: v.to(dtype) for k, v in _canonical_from_hf(sd, cfg, i).items()})
    return model


# the fields that make two configs the same model (the name and init are not among them)
_SHAPE = ("vocab_size", "n_layers", "hidden_size", "n_heads", "n_kv_heads", "ffn_hidden_size",
          "max_seq_len", "activation", "layer_norm_eps")


def _transformers(path: str):
    try:
        import transformers
    except ImportError:
        raise ValueError(f"--init-from {path}: reading a Hugging Face model needs the "
                         f"transformers package (pip install transformers)") from None
    return transformers


@contextlib.contextmanager
def quiet_transformers():
    """transformers' log at errors only and no progress bar (one per rank): its warnings on
    a config (e.g. special token ids outside a small vocabulary) say nothing about the model
    distllm reads, whose shape is checked here."""
    import transformers

    log = transformers.utils.logging
    level, bars = log.get_verbosity(), log.is_progress_bar_enabled()
    log.set_verbosity_error()
    log.disable_progress_bar()
    try:
        yield
    finally:
        log.set_verbosity(level)
        if bars:
            log.enable_progress_bar()


def pretrained_config(path: str) -> GPTConfig:
    """The :class:`GPTConfig` of the Hugging Face GPT-2 folder ``path`` (its config.json, as
    ``save_pretrained`` writes it; nothing is downloaded). ValueError naming ``--init-from``
    for a folder without one, or a config distllm's GPT does not compute."""
    from pathlib import Path

    if not (Path(path) / "config.json").is_file():
        what = "holds no config.json" if Path(path).is_dir() else "is not a folder"
        raise ValueError(f"--init-from {path}: it {what}; pass a folder written by a Hugging "
                         f"Face model's save_pretrained")
    try:
        return config_from_hf(_hf_config(path))
    except ValueError as exc:
        raise ValueError(f"--init-from {path}: {exc}") from None


def _config_errors() -> tuple[type[Exception], ...]:
    """What transformers raises for a config.json value of the wrong type: TypeError, and
    the validation errors of huggingface_hub's strict dataclasses (transformers 5's configs;
    an older huggingface_hub has none)."""
    try:
        from huggingface_hub import errors
    except ImportError:
        return (TypeError,)
    return (TypeError, *(getattr(errors, name) for name in (
        "StrictDataclassFieldValidationError", "StrictDataclassClassValidationError")
        if hasattr(errors, name)))


def _hf_config(path: str):
    """The ``GPT2Config`` of the folder ``path``; a ValueError (one line) for a config.json
    transformers does not read (OSError's text), a ``model_type`` other than ``gpt2`` (a
    config.json without one is read as GPT-2's, as transformers reads it), or a field of
    the wrong type (a string for a number: transformers 5 checks each field's type)."""
    tf = _transformers(path)
    try:
        with quiet_transformers():
            read, _ = tf.GPT2Config.get_config_dict(path, local_files_only=True)
            if not isinstance(read, dict):
                raise ValueError(f"config.json: it holds a {type(read).__name__}, not an "
                                 f"object of GPT-2's fields")
            kind = read.get("model_type", "gpt2")
            if kind != "gpt2":
                raise ValueError(f"config.json: model_type={kind!r}, not 'gpt2': distllm reads "
                                 f"GPT-2 models; pass a folder GPT2LMHeadModel.save_pretrained "
                                 f"wrote")
            return tf.GPT2Config.from_pretrained(path, local_files_only=True)
    except OSError as exc:
        raise ValueError(str(exc)) from None
    except _config_errors() as exc:
        why = " ".join(str(exc).split())
        raise ValueError(f"config.json: {why} (not a GPT-2 config as "
                         f"GPT2LMHeadModel.save_pretrained writes it)") from None


def check_pretrained_shape(theirs: GPTConfig, ours: GPTConfig, model: str, path: str) -> None:
    """ValueError naming ``--model`` (and a preset of the right shape, if one is) when the
    pretrained model ``theirs`` is not the model ``ours`` that ``--model model`` builds."""
    from distllm.models.config import PRESETS

    base = PRESETS.get(model)
    deepened = base is not None and ours.n_layers != base.n_layers  # --n-layers given

    def ours_of(f: str) -> str:
        return f"--n-layers: {ours.n_layers}" if f == "n_layers" and deepened else \
            f"--model {model}: {getattr(ours, f)}"

    diff = [f"{f}={getattr(theirs, f)} ({ours_of(f)})" for f in _SHAPE
            if getattr(theirs, f) != getattr(ours, f)]
    if not diff:
        return

    def fits(c: GPTConfig, but: tuple[str, ...] = ()) -> bool:
        return all(getattr(c, f) == getattr(theirs, f) for f in _SHAPE if f not in but)

    same = [n for n, c in PRESETS.items() if fits(c)]
    deeper = [n for n, c in PRESETS.items() if fits(c, but=("n_layers",))]  # distilgpt2...
    if deepened and fits(base, but=("n_layers",)):  # only --n-layers is wrong
        hint = ("drop --n-layers" if theirs.n_layers == base.n_layers
                else f"pass --n-layers {theirs.n_layers}")
    elif same:
        hint = f"pass --model {same[0]}"
    elif deeper:
        hint = f"pass --model {deeper[0]} --n-layers {theirs.n_layers}"
    else:
        hint = "no preset has its shape"
    raise ValueError(f"--init-from {path}: its model has {', '.join(diff)}: {hint}")


def _gpt2_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a ``GPT2LMHeadModel`` of the model ``cfg`` by its name, with its shape
    (Conv1D weights ``(in, out)``), but ``lm_head.weight``, which a folder may leave to the
    tied embedding."""
    h, f, qkv = cfg.hidden_size, cfg.ffn_hidden_size, 3 * cfg.hidden_size
    out = {"transformer.wte.weight": (cfg.vocab_size, h),
           "transformer.wpe.weight": (cfg.max_seq_len, h),
           "transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)}
    for i in range(cfg.n_layers):
        p = f"transformer.h.{i}."
        out |= {p + "ln_1.weight": (h,), p + "ln_1.bias": (h,), p + "ln_2.weight": (h,),
                p + "ln_2.bias": (h,), p + "attn.c_attn.weight": (h, qkv),
                p + "attn.c_attn.bias": (qkv,), p + "attn.c_proj.weight": (h, h),
                p + "attn.c_proj.bias": (h,), p + "mlp.c_fc.weight": (h, f),
                p + "mlp.c_fc.bias": (f,), p + "mlp.c_proj.weight": (f, h),
                p + "mlp.c_proj.bias": (h,)}
    return out


class _FolderWeights:
    """The tensors of a Hugging Face folder's weight files by ``GPT2LMHeadModel``'s names
    (``GPT2Model``'s, without ``transformer.``, are taken too), each read when asked:
    safetensors (one file or an index of shards) through ``safe_open``, which reads that
    tensor's bytes alone; ``pytorch_model.bin`` (or its shards) memory-mapped
    (``torch.load(mmap=True, weights_only=True)``). ``shapes``: each name's shape, read
    from the files' headers."""

    def __init__(self, path: str):
        import json
        from pathlib import Path

        root = Path(path)
        self._where: dict[str, tuple[str, str]] = {}  # our name -> (file, the file's name)
        self._open: dict[str, object] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for kind in ("model.safetensors", "pytorch_model.bin"):
            index = root / f"{kind}.index.json"
            if index.is_file():
                try:
                    with open(index) as fh:
                        held = json.load(fh)
                except ValueError as exc:  # (cut short, not JSON)
                    raise ValueError(f"--init-from {path}: {index.name} is not valid JSON "
                                     f"({exc}); pass a folder GPT2LMHeadModel.save_pretrained "
                                     f"wrote") from None
                weight_map = held.get("weight_map") if isinstance(held, dict) else None
                if not isinstance(weight_map, dict) or not all(
                        isinstance(f, str) for f in weight_map.values()):
                    raise ValueError(f"--init-from {path}: {index.name} has no weight_map; "
                                     f"pass a folder GPT2LMHeadModel.save_pretrained wrote")
                files = sorted(set(weight_map.values()))
            elif (root / kind).is_file():
                files = [kind]
            else:
                continue
            for name in files:
                for key, shape in self._keys(str(root / name)):
                    bare = key.startswith(("h.", "wte.", "wpe.", "ln_f."))  # GPT2Model's
                    ours = "transformer." + key if bare else key
                    self._where[ours] = (str(root / name), key)
                    self.shapes[ours] = shape
            return
        raise ValueError(f"--init-from {path}: no weights there (model.safetensors, "
                         f"pytorch_model.bin, or an index of their shards); pass a folder "
                         f"GPT2LMHeadModel.save_pretrained wrote")

    def _file(self, f: str):
        if f not in self._open:
            if f.endswith(".safetensors"):
                from safetensors import safe_open

                self._open[f] = safe_open(f, framework="pt")
            else:
                try:
                    self._open[f] = torch.load(f, map_location="cpu", mmap=True,
                                               weights_only=True)
                except RuntimeError:  # torch.save's format before 1.6 cannot be mapped
                    self._open[f] = torch.load(f, map_location="cpu", weights_only=True)
        return self._open[f]

    def _keys(self, f: str):
        opened = self._file(f)
        if isinstance(opened, dict):
            return [(k, tuple(v.shape)) for k, v in opened.items()]
        return [(k, tuple(opened.get_slice(k).get_shape())) for k in opened.keys()]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        f, key = self._where[name]
        opened = self._file(f)
        return opened[key] if isinstance(opened, dict) else opened.get_tensor(key)


def weights_only_refusal(exc: BaseException) -> str | None:
    """What to say of a file ``torch.load(weights_only=True)`` refused (a pickle of more than
    tensors: torch's own message suggests loading it with ``weights_only=False``, which would
    run what it holds), or None for another error."""
    if "weights only load failed" in str(exc).lower():
        return "not a file of tensors that torch.load reads safely"
    return None


def pretrained_layers(path: str, mcfg: GPTConfig, model: str
                      ) -> Callable[[int], dict[str, torch.Tensor]]:
    """The weights of the Hugging Face GPT-2 folder ``path``, checked to be the model
    ``mcfg`` (``--model model``): a function of a layer index (0 the embedding, 1..L the
    blocks, L + 1 the final norm and head) giving that layer's full canonical tensors, in the
    folder's dtype. A layer's tensors are read from the files when it is asked for (so a
    pipeline rank reads its stages' layers, not the model); every name and shape is checked
    first, from the files' headers: a folder that lacks a weight, holds one of another name
    (transformers would leave the model's at random, with a warning) or of another shape is
    refused, naming them."""
    theirs = pretrained_config(path)
    check_pretrained_shape(theirs, mcfg, model, path)
    from safetensors import SafetensorError

    try:
        weights = _FolderWeights(path)
    except (OSError, RuntimeError, SafetensorError, pickle.UnpicklingError) as exc:
        why = weights_only_refusal(exc) or " ".join(str(exc).split())
        raise ValueError(f"--init-from {path}: its weights cannot be read ({why})") from None
    want = _gpt2_shapes(theirs)
    head = {"lm_head.weight": (theirs.vocab_size, theirs.hidden_size)}
    # a tied model's files may hold its head once, as the embedding; an untied one's must
    # hold it (transformers would leave it at random)
    tied = _hf_config(path).tie_word_embeddings
    optional = head if tied else {}
    want |= {} if tied else head
    have = {k: v for k, v in weights.shapes.items()
            if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # GPT-2's mask buffers
    gaps = {"missing keys": sorted(set(want) - set(have)),
            "unexpected keys": sorted(set(have) - set(want) - set(optional)),
            "mismatched keys": sorted(f"{k} {have[k]} (not {shape})"
                                      for k, shape in (want | optional).items()
                                      if k in have and have[k] != shape)}
    if any(gaps.values()):
        said = "; ".join(f"{what}: {', '.join(keys[:4])}"
                         + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
                         for what, keys in gaps.items() if keys)
        raise ValueError(f"--init-from {path}: its weights are not GPT-2's as transformers "
                         f"names them ({said}); pass a folder GPT2LMHeadModel.save_pretrained "
                         f"wrote")
    return lambda i: _canonical_from_hf(weights, theirs, i)


@torch.no_grad()
def to_hf(models: GPT | Iterable[GPT]):
    """A ``GPT2LMHeadModel`` with the weights of ``models`` (this rank's chunks). Collective:
    an all-gather over TP per sharded tensor and, with pp > 1, an all-gather of the layers over
    the PP group; every rank returns the whole model."""
    models = [models] if isinstance(models, GPT) else list(models)
    cfg, dims = models[0].cfg, models[0].dims
    # on the CPU: the HF model is built there, and an object all-gather would otherwise
    # unpickle each stage's CUDA tensors onto the sending rank's device index
    mine = {i: {k: t.cpu() for k, t in gather_layer(m, i).items()}
            for m in models for i in m.layer_ids}
    if dims.pp > 1:
        parts: list = [None] * dims.pp
        dist.all_gather_object(parts, mine, group=dims.pp_group)
        mine = {i: layer for part in parts for i, layer in part.items()}
    return hf_from_layers(cfg, mine)


def hf_from_layers(cfg: GPTConfig, mine: dict[int, dict[str, torch.Tensor]]):
    """A ``GPT2LMHeadModel`` of the model ``cfg`` whose layer ``i`` has the full canonical
    tensors ``mine[i]`` (every layer), in their dtype. No collective. ValueError for a model
    GPT-2 cannot hold (grouped-query attention)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if cfg.n_kv_heads not in (None, cfg.n_heads):
        raise ValueError(f"the model has n_kv_heads={cfg.n_kv_heads} of {cfg.n_heads} heads: "
                         f"Hugging Face's GPT-2 has no grouped-query attention to hold it")

    act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[cfg.activation]
    hf_cfg = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len,
                        n_embd=cfg.hidden_size, n_layer=cfg.n_layers, n_head=cfg.n_heads,
                        n_inner=cfg.ffn_hidden_size, activation_function=act,
                        layer_norm_epsilon=cfg.layer_norm_eps, tie_word_embeddings=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        # GPT-2's <|endoftext|> (50256) only where the vocabulary holds it
                        **({} if cfg.vocab_size > 50256 else
                           {"bos_token_id": None, "eos_token_id": None}))
    dtype = next(iter(mine[0].values())).dtype
    hf = GPT2LMHeadModel(hf_cfg).to(dtype).eval()
    sd = {"transformer.wte.weight": mine[0]["wte.weight"],
          "transformer.wpe.weight": mine[0]["wpe"]}
    head = mine[cfg.n_layers + 1]
    sd["transformer.ln_f.weight"] = head["ln_f.weight"]
    sd["transformer.ln_f.bias"] = head["ln_f.bias"]
    sd["lm_head.weight"] = head.get("lm_head.weight", mine[0]["wte.weight"])
    for i in range(1, cfg.n_layers + 1):
        c, p = mine[i], f"transformer.h.{i - 1}."
        for ours, theirs, transpose in (
            ("ln_1.weight", "ln_1.weight", False), ("ln_1.bias", "ln_1.bias", False),
            ("attn.qkv.weight", "attn.c_attn.weight", True),
            ("attn.qkv.bias", "attn.c_attn.bias", False),
            ("attn.proj.weight", "attn.c_proj.weight", True),
            ("attn.proj.bias", "attn.c_proj.bias", False),
            ("ln_2.weight", "ln_2.weight", False), ("ln_2.bias", "ln_2.bias", False),
            ("mlp.fc.weight", "mlp.c_fc.weight", True), ("mlp.fc.bias", "mlp.c_fc.bias", False),
            ("mlp.proj.weight", "mlp.c_proj.weight", True),
            ("mlp.proj.bias", "mlp.c_proj.bias", False),
        ):
            sd[p + theirs] = c[ours].t().contiguous() if transpose else c[ours]
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith(".attn.bias") and "masked_bias" not in k]
    if missing or unexpected:
        raise RuntimeError(f"to_hf: missing {missing}, unexpected {unexpected}")
    return hf
