"""What the training software does, as far as memory and step time are concerned.

The hardware profile says how fast the machine is; a :class:`Runtime` says which of its
communication the training code overlaps, how it splits layers over pipeline stages, what it
keeps in memory and how its optimizer step runs. ``distllm`` (the default) describes this
package's trainer; ``megatron-lm-2021`` the code behind Narayanan et al. 2021 (Megatron-LM,
arXiv:2104.04473), so that the planner's physics can be checked against that paper's Table 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distllm.models.config import CHECKPOINTING
from distllm.parallel.pipeline.schedules import SCHEDULES

__all__ = ["Runtime", "RUNTIMES", "runtime", "runtime_names"]


@dataclass(frozen=True)
class Runtime:
    """One training code's behaviour, each field with where it comes from (``source``)."""

    name: str
    stage_split: str
    """``entries``: the list [embedding, blocks..., head] is cut into ``pp * v`` chunks as
    evenly as possible, earlier chunks taking the remainder (distllm's engine);
    ``blocks``: the blocks are cut evenly (``layers`` divisible by ``pp * v``), the embedding
    joins the first stage and the head the last (Megatron-LM)."""
    tp_overlap: bool
    """The row-parallel GEMM overlaps its all-reduce in forward (chunked)."""
    dp_overlap: bool
    """The data-parallel gradient reduction overlaps the last micro-batch's backward."""
    grad_bytes_mixed: int
    """Gradient bytes per parameter kept across micro-batches in 16-bit training."""
    optimizer_bytes: float
    """Bytes of memory traffic per (local) parameter of one optimizer step, with the
    gradient-norm clipping and the copy back to the 16-bit weights."""
    optimizer_temp_bytes: float
    """Transient bytes per (local) parameter while the optimizer step runs."""
    p2p_scatter_gather: bool
    """Each TP rank sends 1/tp of a pipeline message, all-gathered over NVLink on arrival."""
    p2p_async: bool
    """Pipeline sends and receives run in the background of compute (replayed by the
    schedule simulator); False: each transfer sits on the critical path (the closed form
    charges it per chunk)."""
    keeps_stage_output: bool
    """A pipeline rank keeps the output it sent for each micro-batch in flight until that
    micro-batch's backward (the root of its autograd graph)."""
    causal_skip: bool
    """The fused attention kernel skips the masked half of the scores."""
    zero_grad_accumulation: str
    """ZeRO-2/3 with several micro-batches: ``full`` (gradients accumulate in full-size
    buffers, reduce-scattered in the last micro-batch) or ``shard`` (reduce-scattered every
    micro-batch into the shard)."""
    zb_h1_resident: bool = False
    """zb-h1's deferred weight-gradient pass needs the parameters and the forward's tensors
    still in memory: the runtime refuses zb-h1 with ZeRO-3 (which releases the parameters
    after use) and with activation checkpointing (whose recomputation frees them)."""
    zb_defers_tp_layers: bool = True
    """zb-h1's W runs the weight-gradient GEMMs of every linear layer (Qi et al. 2024; so does
    distllm's, :mod:`distllm.ops.weight_grad`); False:
    only of the layers that run as plain linears (at tp = 1 the attention's projections and
    the head; a head held whole at tp > 1), while the tensor-parallel layers at tp > 1 and
    the MLP's fused GEMM + GeLU compute theirs in B (where a tensor-parallel backward
    overlaps its collective with that GEMM)."""
    outputs_per_chunk: bool = False
    """With :attr:`keeps_stage_output`: one full output per (micro-batch, chunk) in flight,
    on every chunk but the one with the head (distllm's executor, measured by the dry run);
    False: one per micro-batch in flight on a rank without the head (a v-th of one per chunk
    held), the accounting the ``megatron-lm-2021`` runtime was checked with."""
    keeps_sends: bool = False
    """Every activation and input gradient a pipeline rank sends stays in memory until the end
    of the step, where the sends are waited for (False: freed as each send completes)."""
    keeps_gathered_input: bool = False
    """Under sequence parallelism the column-parallel GEMMs (QKV, the MLP's first) keep the
    all-gathered full-sequence input for their weight gradient; False: they keep their
    sequence shard and all-gather it again in backward (Korthikanti et al. 2022, sec. 4.2.2)."""
    autograd_grads_at_dp1: bool = False
    """On one DP rank at ZeRO stage 0 in fp32 or fp64, the gradients are autograd's own:
    created in backward as it frees the activations, freed after the step (no reducer or
    gradient buffer holds them); False: a buffer holds them all the step."""
    split_loss_frees_logits: bool = False
    """The loss over a vocabulary split over tp > 1 ranks saves only its fp32 softmax: the
    logits are freed after its forward, whose transients are the logits and, for 16-bit
    ones, their fp32 copy; its backward's, the gradient (a copy of the softmax) and its
    cast. False: the logits are kept beside the softmax through backward, as for
    ``F.cross_entropy`` (the accounting the ``megatron-lm-2021`` runtime was checked with)."""
    step_syncs: bool = False
    """Each optimizer step all-reduces scalars on the host's path (the loss, the gradient
    norm, the inf/NaN flag), one small collective each (:meth:`TimeModel.sync_time`)."""
    dtypes: tuple[str, ...] = ()
    """The training dtypes it runs (canonical names, :mod:`distllm.dtypes`); empty: every
    one the planner models."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """The ZeRO stages it has (the search offers only these)."""
    schedules: tuple[str, ...] = tuple(SCHEDULES)
    """The pipeline schedules it has (pp > 1)."""
    checkpointing: tuple[str, ...] = tuple(CHECKPOINTING)
    """The activation recomputation modes it has (``none``, ``selective``, ``full``)."""
    sequence_parallel: bool = True
    """It has sequence parallelism (at tp > 1)."""
    source: dict[str, str] = field(default_factory=dict)

    def zb_deferred(self, tp: int, vocab_split: bool) -> frozenset[str]:
        """The parts (``attention``, ``mlp``, ``head``) whose weight GEMMs zb-h1's W runs at
        ``tp``, the head's vocabulary split over it or not (see :attr:`zb_defers_tp_layers`):
        the planner's one rule for W's memory and time."""
        if self.zb_defers_tp_layers:
            return frozenset({"attention", "mlp", "head"})
        if tp == 1:
            return frozenset({"attention", "head"})
        return frozenset() if vocab_split else frozenset({"head"})

    def check_dtype(self, dtype: str) -> None:
        """Raise, naming ``--dtype`` and ``--runtime``, when this runtime does not train in
        ``dtype`` (a canonical name)."""
        if self.dtypes and dtype not in self.dtypes:
            raise ValueError(
                f"dtype={dtype!r}: the {self.name} runtime does not train in {dtype}: choose "
                f"--dtype from {', '.join(self.dtypes)}, or another --runtime"
            )

    def check_pins(self, pins: dict) -> None:
        """Raise, naming the flag and ``--runtime``, when a pinned field (``zero``,
        ``schedule``, ``checkpointing``, ``sequence_parallel``) asks for what this runtime
        does not have."""
        has: list[tuple[str, object, tuple]] = [
            ("zero", pins.get("zero"), self.zero_stages),
            ("schedule", pins.get("schedule"), self.schedules),
            ("checkpointing", pins.get("checkpointing"), self.checkpointing),
            ("sequence-parallel", "on" if pins.get("sequence_parallel") else None,
             ("off", "on") if self.sequence_parallel else ("off",)),
        ]
        for flag, value, choices in has:
            if value is not None and value not in choices:
                raise ValueError(
                    f"--{flag} {value}: the {self.name} runtime does not have it: choose "
                    f"--{flag} from {', '.join(map(str, choices))}, or another --runtime")


RUNTIMES: dict[str, Runtime] = {
    "distllm": Runtime(
        name="distllm",
        stage_split="entries",
        tp_overlap=True,
        dp_overlap=True,
        grad_bytes_mixed=4,
        optimizer_bytes=50.0,
        optimizer_temp_bytes=0.0,
        p2p_scatter_gather=False,
        p2p_async=True,
        keeps_stage_output=True,
        outputs_per_chunk=True,
        causal_skip=True,
        zero_grad_accumulation="full",
        keeps_gathered_input=True,
        autograd_grads_at_dp1=True,
        split_loss_frees_logits=True,
        step_syncs=True,
        zb_h1_resident=True,
        dtypes=("float32", "bfloat16", "float64"),
        source={
            "stage_split": "distllm.train.engine: _all_chunk_ids over mcfg.n_pipeline_layers",
            "step_syncs": "distllm.train.engine.Engine.update: one world all-reduce of the "
            "norm's squares and the loss (DDP: clip_grad_norm_and_sum_; ZeRO over dp > 1: "
            "ZeroOptimizer.clip_and_check, with the inf/NaN flag); three where ZeRO checks "
            "one by one",
            "tp_overlap": "distllm.nn row-parallel layers: chunked GEMM + all-reduce (--overlap)",
            "dp_overlap": "distllm.parallel.data: buckets reduced as backward fills them",
            "grad_bytes_mixed": "ZeroOptimizer: fp32 gradient buckets under bf16 "
            "(reduce_dtype = master dtype)",
            "optimizer_bytes": "torch.optim.AdamW(fused=True) on fp32 masters, one pass: "
            "reads master, gradient and both moments (16), writes master and both moments "
            "(12); clipping norm and scale (12); bf16 copy of the masters (6); zeroing (4)",
            "optimizer_temp_bytes": "AdamW(fused=True) updates in place: no temporary",
            "p2p_async": "distllm.parallel.pipeline.pp_comm: batched isend/irecv, waited "
            "for only by the compute that consumes them",
            "keeps_stage_output": "distllm.parallel.pipeline.executor holds each micro-batch's "
            "stage output until its backward (_StepRun.outputs)",
            "outputs_per_chunk": "distllm.parallel.pipeline.executor: _StepRun.outputs is "
            "keyed by (micro-batch, chunk); the dry run of an interleaved pp2 (tests/plan/"
            "test_dry_run.py) reads 2.5 messages more on rank 0 than one per micro-batch",
            "keeps_sends": "distllm.parallel.pipeline.pp_comm.StageComm drops each send once "
            "it has completed (_drop_sent, at every flush; on gloo an activation's when its "
            "gradient returns, _release)",
            "autograd_grads_at_dp1": "distllm.parallel.data.ddp: with dims.dp == 1 no reducer "
            "(gradients as autograd produced them); Engine.update zero_grad sets them to None",
            "keeps_gathered_input": "distllm.parallel.tensor.layers._ColumnParallelMatmul and "
            "fused_mlp save x_full, the all-gathered input, for the weight gradient",
            "causal_skip": "torch scaled_dot_product_attention(is_causal=True)",
            "zero_grad_accumulation": "distllm.parallel.data buckets: non-persistent "
            "buffers filled under no_sync() until the last micro-batch",
            "zb_h1_resident": "distllm.train.config.TrainConfig refuses zb-h1 with zero=3 "
            "and with activation checkpointing",
            "zb_defers_tp_layers": "distllm.ops.weight_grad: W runs the weight GEMMs of "
            "plain linears, of the tensor-parallel layers and of the fused GEMM + GeLU and "
            "MLP (their backward asks weight_grad_store); B accumulates the other gradients",
            "dtypes": "distllm.train.config.TRAIN_DTYPES (no float16 training)",
            "split_loss_frees_logits": "distllm.nn.cross_entropy._VocabParallelCrossEntropy "
            "saves the softmax alone and distllm.models.gpt.gpt_loss holds no logits after it; "
            "gpt_loss takes F.cross_entropy at tp = 1 and for a vocabulary held whole",
        },
    ),
    "megatron-lm-2021": Runtime(
        name="megatron-lm-2021",
        stage_split="blocks",
        tp_overlap=False,
        dp_overlap=False,
        grad_bytes_mixed=2,
        optimizer_bytes=52.0,
        optimizer_temp_bytes=4.0,
        p2p_scatter_gather=True,
        p2p_async=False,
        keeps_stage_output=True,
        causal_skip=False,
        zero_grad_accumulation="shard",
        zero_stages=(0,),
        schedules=("1f1b", "interleaved-1f1b"),
        checkpointing=("none", "full"),
        sequence_parallel=False,
        source={
            "paper": "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on "
            "GPU Clusters Using Megatron-LM' (arXiv:2104.04473)",
            "stage_split": "Megatron-LM: --num-layers divided evenly over pipeline stages "
            "(and over model chunks with interleaving)",
            "tp_overlap": "Megatron-LM 2021: RowParallelLinear all-reduces after its GEMM",
            "dp_overlap": "Megatron-LM 2021 local DDP: allreduce_gradients() after the "
            "pipeline flush (paper sec. 4.2: data-parallel communication once per batch)",
            "grad_bytes_mixed": "fp16 training: main_grad buffer in the parameter dtype",
            "optimizer_bytes": "fp16 optimizer: grad copy to fp32 (6), unscale and inf check "
            "(8), norm (4), apex FusedAdam (read p, g, m, v, write p, m, v: 28), copy to fp16 "
            "weights (6)",
            "optimizer_temp_bytes": "fp16 optimizer: main_grad.float() makes an fp32 copy",
            "p2p_scatter_gather": "paper sec. 4.1: scatter/gather communication optimization",
            "p2p_async": "Megatron-LM 2021 p2p_communication: batch_isend_irecv, waited at "
            "once, then torch.cuda.synchronize()",
            "keeps_stage_output": "Megatron-LM 2021 schedules keep output_tensors for backward",
            "outputs_per_chunk": "not checked against the 2021 code: the earlier accounting "
            "(one output per micro-batch in flight), with which Table 1's 1T layout (tp8.pp64 "
            "v2 m512) fits its 80 GB; a full one per (micro-batch, chunk) would put it at "
            "83 GB, so the paper's run freed more than that (its flags are not modelled)",
            "causal_skip": "no fused attention: the full s x s scores (paper sec. 5)",
            "keeps_sends": "Megatron-LM 2021 p2p_communication waits for each batch of "
            "transfers at once",
            "keeps_gathered_input": "no sequence parallelism in the 2021 code; the later one "
            "all-gathers the input again in backward (Korthikanti et al. 2022)",
            "zero_grad_accumulation": "no ZeRO in the paper's runs",
            "zero_stages": "Megatron-LM 2021 has no ZeRO (its distributed optimizer came "
            "later): stage 0 only",
            "schedules": "Megatron-LM 2021 schedules.py: no pipelining, 1F1B "
            "(PipeDream-Flush) and interleaved 1F1B; no GPipe, no zero-bubble schedule",
            "checkpointing": "Megatron-LM 2021 --checkpoint-activations recomputes whole "
            "layers; selective recomputation came with Korthikanti et al. 2022",
            "sequence_parallel": "no sequence parallelism in the 2021 code (Korthikanti et "
            "al. 2022)",
        },
    ),
}


def runtime_names() -> list[str]:
    return sorted(RUNTIMES)


def runtime(name: str | Runtime) -> Runtime:
    """A runtime by name (``distllm``, ``megatron-lm-2021``)."""
    if isinstance(name, Runtime):
        return name
    if name not in RUNTIMES:
        raise ValueError(f"unknown runtime {name!r}: choose --runtime from "
                         f"{', '.join(runtime_names())}")
    return RUNTIMES[name]
