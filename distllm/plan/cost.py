"""The cost model: memory per device and time per step of one layout.

Memory (bytes per device, on the heaviest pipeline stage):
  * model states after the ZeRO paper (Rajbhandari et al. 2020, sec. 3-5): with mixed precision
    and Adam, 2 bytes of parameters + 2 of gradients + 12 of optimizer states (fp32 master,
    momentum, variance) per parameter; stage 1 divides the 12 by the DP size, stage 2 the
    gradients too, stage 3 everything. float32 training keeps 4 + 4 + 8, float64 8 + 8 + 16.
  * activations per layer and micro-batch after Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models", sec. 4): s*b*h*(34 + 5*a*s/h) bytes in 16 bits
    with dropout; (10 + 24/t) without and 34/t with sequence parallelism (plus 4*(1 - 1/t)
    for a runtime whose GEMMs keep their all-gathered input); selective recomputation drops
    the attention core, full recomputation keeps only each layer's input. Generalised here to
    any element size, GQA, gated MLPs, flash attention and no dropout.
  * times the micro-batches each local chunk holds, at the moment of the rank's schedule
    that holds the most (:func:`~distllm.plan.bubble.memory_states`: 1F1B p - r on rank r;
    GPipe m; interleaved up to 2(p - r - 1) + (v - 1)p + 1 chunks, the larger ones counted
    as such), with the pipeline messages the runtime keeps by then.
  * with ZeRO-2/3 and more than one micro-batch, the full-size gradient buffers that the
    micro-batches accumulate into (``grad_buffers``), alive beside the activations.

Which code runs (the stage split, the gradient dtype, what the pipeline keeps of what it
sends) is the :class:`~distllm.plan.runtime.Runtime`'s; step time is
:mod:`distllm.plan.timing`'s.
"""

from __future__ import annotations

from distllm.dtypes import canonical_dtype

from .bubble import memory_states
from .collectives import collective_time
from .hardware import Profile
from .layout import GB, Estimate, Layout
from .model import ModelShape
from .runtime import Runtime, runtime
from .timing import TimeModel

__all__ = [
    "Layout",
    "Estimate",
    "CostModel",
    "STATE_BYTES",
    "collective_time",
    "state_bytes",
    "training_dtype",
    "GB",
]

# (parameter, gradient, optimizer) bytes per parameter, per training dtype (Adam/AdamW).
STATE_BYTES = {
    "bfloat16": (2, 2, 12),
    "float16": (2, 2, 12),
    "float32": (4, 4, 8),
    "float64": (8, 8, 16),
}
ACT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def training_dtype(dtype: str) -> str:
    """The canonical name (:mod:`distllm.dtypes`) of a dtype the planner models; an error
    names ``--dtype``."""
    try:
        d = canonical_dtype(dtype)
    except ValueError:
        d = None
    if d not in STATE_BYTES:
        raise ValueError(f"dtype={dtype!r}: choose --dtype from {', '.join(STATE_BYTES)}")
    return d


def state_bytes(n_params: float, dp: int, zero: int, per: tuple[int, int, int]) -> dict:
    """Bytes of parameters, gradients and optimizer states of ``n_params`` parameters under
    a ZeRO stage over ``dp`` ranks, at ``per`` = (parameter, gradient, optimizer) bytes."""
    pb, gb, ob = per
    return {
        "params": pb * n_params / (dp if zero >= 3 else 1),
        "grads": gb * n_params / (dp if zero >= 2 else 1),
        "optimizer": ob * n_params / (dp if zero >= 1 else 1),
    }


class CostModel(TimeModel):
    """Predicts memory and step time of layouts for one model on one cluster."""

    def __init__(
        self,
        shape: ModelShape,
        profile: Profile,
        world: int,
        gpus_per_node: int,
        *,
        dtype: str = "bfloat16",
        flash_attention: bool = True,
        bucket_mb: float = 25.0,
        simulator=None,
        ranks_per_host: int | None = None,
        runtime_name: str | Runtime = "distllm",
    ) -> None:
        self.shape, self.profile = shape, profile
        self.runtime = runtime(runtime_name)
        self.world, self.gpn = world, gpus_per_node
        self.dtype = training_dtype(dtype)
        self.runtime.check_dtype(self.dtype)
        self.e = ACT_BYTES[self.dtype]
        self.flash = flash_attention
        self.bucket_bytes = bucket_mb * 2**20
        self.simulator = simulator
        # ranks that share one host's cores (CPU profiles): a node's, unless said otherwise
        self.ranks_per_host = ranks_per_host or min(world, gpus_per_node)
        self.peak = profile.flops(self.dtype)
        self.param_bytes, grad, self.optim_bytes = STATE_BYTES[self.dtype]
        # 16-bit training: the gradient dtype the runtime accumulates and reduces in
        self.grad_bytes = self.runtime.grad_bytes_mixed if self.e == 2 else grad
        self._cache: dict = {}

    # ---------------------------------------------------------------- memory --------
    def chunks(self, pp: int, v: int) -> list[list[tuple[int, bool, bool]]]:
        """(blocks, holds the embedding, holds the head) of each local chunk of each pipeline
        rank; chunk ``c`` of the ``pp * v`` runs on rank ``c % pp`` as its local chunk
        ``c // pp``.

        Runtime ``entries`` (distllm's engine): the list embedding, blocks, head
        (``layers + 2`` entries) cut as evenly as possible, earlier chunks taking the
        remainder. Runtime ``blocks`` (Megatron-LM): the blocks cut as evenly, the embedding
        added to the first chunk and the head to the last.
        """
        key = ("chunks", pp, v)
        if key not in self._cache:
            blocks_only = self.runtime.stage_split == "blocks"
            n = self.shape.layers + (0 if blocks_only else 2)
            base, extra = divmod(n, pp * v)
            out: list[list[tuple[int, bool, bool]]] = [[] for _ in range(pp)]
            lo = 0
            for c in range(pp * v):
                hi = lo + base + (1 if c < extra else 0)
                first, last = lo == 0, hi == n
                blocks = (hi - lo) - (0 if blocks_only else first + last)
                out[c % pp].append((blocks, first, last))
                lo = hi
            self._cache[key] = out
        return self._cache[key]

    def ranks(self, pp: int, v: int) -> list[tuple[int, bool, bool]]:
        """(blocks, holds the embedding, holds the head) of each pipeline rank: its chunks
        (:meth:`chunks`) together."""
        key = ("ranks", pp, v)
        if key not in self._cache:
            self._cache[key] = [
                (sum(c[0] for c in cs), any(c[1] for c in cs), any(c[2] for c in cs))
                for cs in self.chunks(pp, v)
            ]
        return self._cache[key]

    def _heavy_ranks(self, pp: int, v: int, schedule: str = "") -> tuple[int, ...]:
        """Ranks that can need the most memory or time: the first, the first with the most
        blocks (in-flight counts fall with the rank), the last (the head and its logits).
        Under zb-h1 (memory), every rank: the micro-batches waiting for W pile up on the later
        ranks, and what they keep can outweigh the earlier ranks' extra held micro-batches."""
        key = ("heavy", pp, v, schedule == "zb-h1")
        if key not in self._cache:
            ranks = self.ranks(pp, v)
            most = max(r[0] for r in ranks)
            first_most = next(i for i, r in enumerate(ranks) if r[0] == most)
            self._cache[key] = (tuple(range(pp)) if schedule == "zb-h1"
                                else tuple(sorted({0, first_most, pp - 1})))
        return self._cache[key]

    def rank_params(self, lay: Layout) -> tuple[list[float], float]:
        """Parameters held per device on each pipeline rank, and those of one block."""
        key = ("params", lay.tp, lay.pp, lay.virtual_stages, lay.sequence_parallel)
        if key not in self._cache:
            s, t = self.shape, lay.tp
            h = s.hidden
            repl = (2 * h if s.biases else 0) + (4 * h if s.biases else 2 * h)  # row biases, norms
            per_layer = (s.layer_params() - repl) / t + repl
            emb, head = self.end_params(lay)
            out = [
                blocks * per_layer + (emb if has_e else 0) + (head if has_h else 0)
                for blocks, has_e, has_h in self.ranks(lay.pp, lay.virtual_stages)
            ]
            self._cache[key] = (out, per_layer)
        return self._cache[key]

    def end_params(self, lay: Layout) -> tuple[float, float]:
        """Parameters held per device by the embedding layer and by the head (its norm, and
        its output projection unless tied to the embedding on the same rank)."""
        s, h = self.shape, self.shape.hidden
        vocab = s.vocab_rows(lay.tp, lay.sequence_parallel) * h
        emb = vocab + (s.seq_len * h if s.learned_positions else 0)
        head = (2 * h if s.biases else h) + (0 if s.tied_embeddings and lay.pp == 1 else vocab)
        return emb, head

    def model_state_bytes(self, n_params: float, dp: int, zero: int) -> dict[str, float]:
        return state_bytes(n_params, dp, zero, (self.param_bytes, self.grad_bytes,
                                                self.optim_bytes))

    def layer_activation_bytes(self, b: int, tp: int, sp: bool, ckpt: str) -> float:
        """Bytes one block keeps for backward per micro-batch of b sequences, per TP rank."""
        key = ("act", b, tp, sp, ckpt)
        if key in self._cache:
            return self._cache[key]
        s, e = self.shape, self.e
        d = 1 if s.dropout else 0
        sbh, bs = b * s.seq_len * s.hidden, b * s.seq_len
        norm_in = (2 * e + 2 * d) * sbh  # 2 norm inputs, 2 dropout masks
        norm_out = 2 * e * sbh  # 2 norm outputs: the inputs of the QKV and first MLP GEMMs
        if not sp:
            repl = norm_in + norm_out
        elif self.runtime.keeps_gathered_input:  # each GEMM keeps its all-gathered input
            repl = norm_in / tp + norm_out
        else:
            repl = (norm_in + norm_out) / tp
        mlp = (3 if s.gated_mlp else 2) * e * bs * s.ffn
        shard = e * (2 * sbh + 2 * bs * s.kv_dim) + mlp  # Q, out-proj input, K, V, MLP
        if self.flash:
            core = 4 * b * s.heads * s.seq_len  # fp32 log-sum-exp per row
        else:
            sq = b * s.heads * s.seq_len**2
            core = (e + d + (e if d else 0)) * sq  # softmax (+ dropout mask and output)
        full = repl + (shard + core) / tp
        if ckpt == "none":
            out = full
        elif ckpt == "selective":
            out = full - core / tp
        else:  # full: the block input only; one block's `full` is live during its recompute
            out = e * sbh / (tp if sp else 1)
        self._cache[key] = out
        return out

    def memory(self, lay: Layout) -> dict[str, float]:
        """Bytes per device on the pipeline rank that needs the most."""
        key = ("memory", lay)  # the search asks once to filter and again to rank
        if key not in self._cache:
            self._cache[key] = max(
                (self.rank_memory(lay, r)
                 for r in self._heavy_ranks(lay.pp, lay.virtual_stages, lay.schedule)),
                key=lambda m: m["total"],
            )
        return dict(self._cache[key])

    def heaviest_rank(self, lay: Layout) -> int:
        """The pipeline rank whose memory :meth:`memory` reports."""
        return max(
            self._heavy_ranks(lay.pp, lay.virtual_stages, lay.schedule),
            key=lambda r: self.rank_memory(lay, r)["total"],
        )

    def rank_memory(self, lay: Layout, r: int) -> dict[str, float]:
        """Bytes on pipeline rank ``r``: model states, activations at the peak of
        forward-backward and ZeRO-2/3's gradient accumulation buffers alive then
        (``grad_buffers``), the optimizer step's peak, and the largest as ``total``
        (ZeRO-3 never holds the stage's weights whole: the engine materialises and shards
        one layer at a time)."""
        s = self.shape
        b = s.global_batch // (lay.dp * lay.micro_batches)
        params, per_layer = self.rank_params(lay)
        _, has_e, has_h = self.ranks(lay.pp, lay.virtual_stages)[r]
        mem = self.model_state_bytes(params[r], lay.dp, lay.zero)
        unit = self._largest_unit(lay, per_layer, has_e, has_h)
        if lay.zero >= 3:  # the gathered unit being used and the next block, prefetched
            mem["params"] += (unit + per_layer) * self.param_bytes
        buffers, landing = self._grads_in_flight(lay, params[r], unit)
        # ZeRO-2/3's full-size accumulation buffers, alive beside the activations from a
        # chunk's first backward: both as at the moment of their largest sum
        mem["activations"], mem["grad_buffers"] = self._activations(
            lay, b, r, landing, buffers > 0)
        act = mem["activations"] + mem["grad_buffers"]
        states = mem["params"] + mem["grads"] + mem["optimizer"]
        # the optimizer step's temporaries come after the activations are freed
        local = params[r] / (lay.dp if lay.zero >= 1 else 1)
        mem["optimizer_step"] = states + self.runtime.optimizer_temp_bytes * local
        fb = states + act
        if self._autograd_grads(lay):
            # the gradients arrive as backward frees the activations (the last layer's first):
            # the peak is near one end, all activations or all gradients
            fb = mem["params"] + mem["optimizer"] + max(act, mem["grads"])
        mem["total"] = max(fb, mem["optimizer_step"])
        return mem

    def _autograd_grads(self, lay: Layout) -> bool:
        """Whether the gradients are autograd's own, created in backward and freed after the
        step, rather than held all the step: a runtime without a gradient buffer there
        (:attr:`Runtime.autograd_grads_at_dp1`), one DP rank and ZeRO stage 0 (no reducer and
        its buckets) in fp32 or fp64 (16-bit training keeps fp32 master gradients), one
        micro-batch (more accumulate gradients beside the next one's activations)."""
        return (self.runtime.autograd_grads_at_dp1 and lay.dp == 1 and lay.zero == 0
                and self.e != 2 and lay.micro_batches == 1)

    def _largest_unit(self, lay: Layout, per_layer: float, has_e: bool, has_h: bool) -> float:
        """Parameters of the largest layer on a rank (a block, the embedding or the head):
        the unit ZeRO-3 gathers whole, and the largest single gradient."""
        s, t = self.shape, lay.tp
        vocab = s.vocab_rows(t, lay.sequence_parallel) * s.hidden
        emb = vocab + (s.seq_len * s.hidden if s.learned_positions else 0)
        head = 0 if s.tied_embeddings and lay.pp == 1 else vocab
        return max(per_layer, emb if has_e else 0, head if has_h else 0)

    def _grads_in_flight(self, lay: Layout, n_params: float, unit: float) -> tuple[float, float]:
        """Gradient bytes during backward beyond the resident gradients: (buffers alive all
        through backward, the largest transient as one layer's gradients land).

        Buffers: with ZeRO-2/3, micro-batches that accumulate in full-size buffers keep all
        of them. Transient: a 16-bit gradient before it is added to a wider bucket, and with
        ZeRO-2/3 the bucket it lands in, until its reduction is done."""
        mixed = self.grad_bytes != self.param_bytes  # grads land in another dtype's bucket
        landing = self.param_bytes * unit if mixed else 0.0
        if lay.zero < 2:
            return 0.0, landing
        if lay.micro_batches > 1 and self.runtime.zero_grad_accumulation == "full":
            return self.grad_bytes * n_params, landing
        # ZeRO-3 reduces one layer per bucket; ZeRO-2 up to the bucket cap (never more than
        # the rank holds)
        bucket = unit if lay.zero >= 3 else min(max(unit, self.bucket_bytes / self.grad_bytes),
                                                n_params)
        return 0.0, landing + self.grad_bytes * bucket

    def _activations(self, lay: Layout, b: int, r: int, landing: float = 0.0,
                     buffers: bool = False) -> tuple[float, float]:
        """(activation bytes, gradient buffer bytes) of pipeline rank ``r`` at the peak of
        forward-backward; ``landing``: the gradient bytes in flight as one layer's gradients
        land (see _grads_in_flight); ``buffers``: whether the micro-batches accumulate into
        full-size gradient buffers (a chunk's: its parameters' gradients).

        The peak is the largest of the moments :func:`~distllm.plan.bubble.memory_states`
        replays from the rank's schedule: each local chunk's activations times the
        micro-batches it holds then, the messages kept, during a backward that pass's
        transient, and the buffers of the chunks whose first backward has run."""
        # the ZeRO stages of one layout differ here only in ``landing`` and ``buffers``:
        # replay once for those that agree
        key = ("activations", lay.tp, lay.pp, lay.virtual_stages, lay.schedule,
               lay.micro_batches, lay.checkpointing, lay.sequence_parallel, b, r, landing,
               buffers)
        if key not in self._cache:
            self._cache[key] = self._replay_activations(lay, b, r, landing, buffers)
        return self._cache[key]

    def _replay_activations(self, lay: Layout, b: int, r: int, landing: float,
                            buffers: bool) -> tuple[float, float]:
        s, rt = self.shape, self.runtime
        per = self.layer_activation_bytes(b, lay.tp, lay.sequence_parallel, lay.checkpointing)
        bs = b * s.seq_len
        rows = s.vocab_rows(lay.tp, lay.sequence_parallel)
        # the logits and the (log-)softmax the loss keeps, computed in fp32 or wider (the
        # softmax alone where the loss over a split vocabulary frees the logits:
        # Runtime.split_loss_frees_logits)
        soft = max(self.e, 4)
        cast = self.e if self.e < soft else 0
        frees = rt.split_loss_frees_logits and lay.tp > 1 and s.splits_vocab(
            lay.tp, lay.sequence_parallel)
        logits = (soft if frees else self.e + soft) * bs * rows
        sp = lay.tp if lay.sequence_parallel else 1
        # a message between stages: one micro-batch's residual stream (b, s / sp, h)
        msg = self.e * bs * s.hidden / sp
        # the embedding's output is the first block's input (counted there); its dropout
        # keeps a byte mask per element
        emb = (1 if s.dropout else 0) * bs * s.hidden / sp
        # gradients alive while one block runs backward: the MLP's inner gradient and two of
        # the residual stream (the saved tensors of that block are freed as it goes)
        work = self.e * (bs * s.ffn / lay.tp + 2 * bs * s.hidden)
        # the head's backward starts with the gradient of the logits in the softmax's dtype
        # and, for 16-bit logits, its cast to theirs; where the loss frees the logits, its
        # forward held them and their fp32 copy beside the softmax
        head = max(self.e + (soft if cast else 0) if frees else 0, soft + cast) * bs * rows
        # one block's activations live while it is recomputed
        redo = (self.layer_activation_bytes(b, lay.tp, lay.sequence_parallel, "none")
                if lay.checkpointing == "full" else 0.0)
        v, pipelined = lay.virtual_stages, lay.pp > 1
        chunks = self.chunks(lay.pp, v)[r]
        # a runtime that frees its sends as they complete keeps each stage output until its
        # micro-batch's backward (the schedule holds it, not autograd): one message per
        # (micro-batch, chunk) in flight, except on the chunk with the head, whose output is
        # the loss (Runtime.outputs_per_chunk); else one per micro-batch on a rank without
        # the head, a v-th of one per chunk held
        keeps_output = pipelined and rt.keeps_stage_output and not rt.keeps_sends
        per_rank = (msg / v if keeps_output and not rt.outputs_per_chunk
                    and not any(has_h for _, _, has_h in chunks) else 0.0)
        # chunks of the same contents hold the same bytes: one group each
        kinds: dict[tuple[int, bool, bool], int] = {}
        groups = tuple(kinds.setdefault(c, len(kinds)) for c in chunks)
        # zb-h1, between B and W: the deferred weight gradients' inputs and output gradients,
        # and the stage input (freed by W)
        wait_w = self._deferred_bytes(lay, b) if lay.schedule == "zb-h1" else (0.0, 0.0)
        emb_n, head_n = self.end_params(lay)
        per_layer = self.rank_params(lay)[1]
        held, transient, deferred, grads = [], [], [], []
        for blocks, has_e, has_h in kinds:
            grads.append(self.grad_bytes * (blocks * per_layer + (emb_n if has_e else 0.0)
                                            + (head_n if has_h else 0.0)) if buffers else 0.0)
            out = msg if keeps_output and rt.outputs_per_chunk and not has_h else per_rank
            held.append(blocks * per + (emb if has_e else 0.0) + (logits if has_h else 0.0) + out)
            deferred.append(blocks * wait_w[0] + (wait_w[1] if has_h else 0.0)
                            + (0.0 if has_e else msg))
            # one of these transients at a time: a block's backward, the head's, or a layer's
            # gradients landing (the saved tensors of the layer before are freed by then)
            transient.append(max(work if blocks else 0.0, head if has_h else 0.0, landing)
                             + (redo if blocks else 0.0))
        sent = msg if pipelined and rt.keeps_sends else 0.0
        posted = msg if pipelined and rt.p2p_async else 0.0
        states = memory_states(lay.schedule, lay.pp, lay.micro_batches, v, r, groups)
        return max((
            (sum(n * a for n, a in zip(st.held, held, strict=True))
             + sum(n * a for n, a in zip(st.deferred, deferred, strict=True))
             + st.sent * sent + st.posted * posted
             + (transient[st.running] if st.running >= 0 else 0.0),
             sum(n * a for n, a in zip(st.grads, grads, strict=True)))
            for st in states
        ), key=sum)

    def _deferred_bytes(self, lay: Layout, b: int) -> tuple[float, float]:
        """(one block's, the head's) bytes that zb-h1 keeps from B to W for one micro-batch of
        ``b`` sequences: each deferred linear's input and output gradient, for the parts
        :meth:`Runtime.zb_deferred` names."""
        s, t = self.shape, lay.tp
        bs = b * s.seq_len
        gates = 2 if s.gated_mlp else 1
        h, f, kv = s.hidden, s.ffn, s.kv_dim
        parts = self.runtime.zb_deferred(t, s.splits_vocab(t, lay.sequence_parallel))
        block = head = 0.0
        # under sequence parallelism the column-parallel GEMMs keep the all-gathered input
        # and the row-parallel ones the all-gathered output gradient: full-sequence rows
        if "attention" in parts:
            block += self.e * bs * (h + (h + 2 * kv) / t  # QKV: its input, its output's grad
                                    + h / t + h)  # output projection
        if "mlp" in parts:
            block += self.e * bs * (h + gates * f / t  # MLP input
                                    + f / t + h)  # MLP output
        if "head" in parts:
            head = self.e * bs * (s.hidden + s.vocab_rows(t, lay.sequence_parallel))
        return block, head

    def evaluate(self, lay: Layout) -> Estimate:
        est = Estimate(lay, memory=self.memory(lay))
        step, parts = self.step_time(lay)
        est.step_time_s, est.time = step, parts
        est.mfu = self.shape.model_flops_per_step() / (step * self.world * self.peak)
        return est
