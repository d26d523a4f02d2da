"""The cost model: memory per device and time per step of one layout.

Memory (bytes per device, on the heaviest pipeline stage):
  * model states after the ZeRO paper (Rajbhandari et al. 2020, sec. 3-5): with mixed precision
    and Adam, 2 bytes of parameters + 2 of gradients + 12 of optimizer states (fp32 master,
    momentum, variance) per parameter; stage 1 divides the 12 by the DP size, stage 2 the
    gradients too, stage 3 everything. float32 training keeps 4 + 4 + 8, float64 8 + 8 + 16.
  * activations per layer and micro-batch after Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models", sec. 4): s*b*h*(34 + 5*a*s/h) bytes in 16 bits
    with dropout; (10 + 24/t) without and 34/t with sequence parallelism; selective
    recomputation drops the attention core, full recomputation keeps only each layer's input.
    Generalised here to any element size, GQA, gated MLPs, flash attention and no dropout.
  * times the micro-batches in flight of the schedule (1F1B: p on the first stage; GPipe: m;
    interleaved: p + (p-1)/v; ZB-H1: as 1F1B).

Step time: GEMM FLOPs at the profile's efficiency, memory-bound work at its bandwidth, an
alpha-beta time per collective on its link class (ring, or tree where cheaper, for
all-reduce), overlap credited only where distllm overlaps (the row-parallel GEMM with its
all-reduce in forward, the DP bucket reduction with the last micro-batch's backward, the
ZeRO-3 prefetched gather with the previous layer) and only to the extent the link's
``overlap`` allows, and the pipeline bubble (see :mod:`distllm.plan.bubble`).
"""

from __future__ import annotations

import math

from .bubble import in_flight, pipeline_time
from .hardware import Link, Profile, canonical_dtype
from .layout import GB, Estimate, Layout
from .model import ModelShape

__all__ = ["Layout", "Estimate", "CostModel", "STATE_BYTES", "collective_time", "GB"]

# (parameter, gradient, optimizer) bytes per parameter, per training dtype (Adam/AdamW).
STATE_BYTES = {
    "bfloat16": (2, 2, 12),
    "float16": (2, 2, 12),
    "float32": (4, 4, 8),
    "float64": (8, 8, 16),
}
ACT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
OVERLAP_CHUNKS = 4  # chunks of the overlapped row-parallel GEMM + all-reduce
OPS_PER_LAYER_FWD = 24  # eager operators of one block's forward (norms, GEMMs, attention, ...)


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Alpha-beta time of one collective of ``nbytes`` (the full buffer) over ``n`` ranks.

    ring all-reduce 2(n-1) steps of nbytes/n; tree all-reduce 2*log2(n) latencies and 2x the
    bytes (pipelined); the cheaper of the two is taken, as NCCL does. reduce-scatter and
    all-gather are half a ring all-reduce. p2p is one message.
    """
    if n <= 1 and kind != "p2p":
        return 0.0
    a, b = link.latency, link.beta
    if kind == "p2p":
        return a + nbytes * b
    ring_half = (n - 1) * a + (n - 1) / n * nbytes * b
    if kind in ("reduce_scatter", "all_gather"):
        return ring_half
    if kind == "all_reduce":
        tree = 2 * math.ceil(math.log2(n)) * a + 2 * nbytes * b
        return min(2 * ring_half, tree)
    raise ValueError(f"unknown collective {kind!r}")


class CostModel:
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
    ) -> None:
        self.shape, self.profile = shape, profile
        self.world, self.gpn = world, gpus_per_node
        self.dtype = canonical_dtype(dtype)
        if self.dtype not in STATE_BYTES:
            raise ValueError(f"dtype={dtype!r}: choose --dtype from {', '.join(STATE_BYTES)}")
        self.e = ACT_BYTES[self.dtype]
        self.flash = flash_attention
        self.bucket_bytes = bucket_mb * 2**20
        self.simulator = simulator
        # ranks that share one host's cores (CPU profiles): a node's, unless said otherwise
        self.ranks_per_host = ranks_per_host or min(world, gpus_per_node)
        self.peak = profile.flops(self.dtype)
        self.rate = self.peak * profile.matmul_efficiency
        self._cache: dict = {}

    # ---------------------------------------------------------------- memory --------
    def ranks(self, pp: int, v: int) -> list[tuple[int, bool, bool]]:
        """(blocks, holds the embedding, holds the head) of each pipeline rank.

        As distllm's engine splits them: the layer list is embedding, blocks, head
        (``layers + 2`` entries) cut into ``pp * v`` chunks as evenly as possible, earlier
        chunks taking the remainder; chunk c runs on rank ``c % pp``.
        """
        key = ("ranks", pp, v)
        if key not in self._cache:
            n = self.shape.layers + 2
            base, extra = divmod(n, pp * v)
            out = [[0, False, False] for _ in range(pp)]
            lo = 0
            for c in range(pp * v):
                hi = lo + base + (1 if c < extra else 0)
                r = out[c % pp]
                r[1] |= lo == 0
                r[2] |= hi == n
                r[0] += (hi - lo) - (lo == 0) - (hi == n)
                lo = hi
            self._cache[key] = [tuple(r) for r in out]
        return self._cache[key]

    def _heavy_ranks(self, pp: int, v: int) -> tuple[int, ...]:
        """Ranks that can need the most memory or time: the first, the first with the most
        blocks (in-flight counts fall with the rank), the last (the head and its logits)."""
        key = ("heavy", pp, v)
        if key not in self._cache:
            ranks = self.ranks(pp, v)
            most = max(r[0] for r in ranks)
            first_most = next(i for i, r in enumerate(ranks) if r[0] == most)
            self._cache[key] = tuple(sorted({0, first_most, pp - 1}))
        return self._cache[key]

    def rank_params(self, lay: Layout) -> tuple[list[float], float]:
        """Parameters held per device on each pipeline rank, and those of one block."""
        key = ("params", lay.tp, lay.pp, lay.virtual_stages)
        if key not in self._cache:
            s, t = self.shape, lay.tp
            h = s.hidden
            repl = (2 * h if s.biases else 0) + (4 * h if s.biases else 2 * h)  # row biases, norms
            per_layer = (s.layer_params() - repl) / t + repl
            vocab = s.padded_vocab(t) * h / t
            emb = vocab + (s.seq_len * h if s.learned_positions else 0)
            head = (2 * h if s.biases else h) + (0 if s.tied_embeddings and lay.pp == 1 else vocab)
            out = [
                blocks * per_layer + (emb if has_e else 0) + (head if has_h else 0)
                for blocks, has_e, has_h in self.ranks(lay.pp, lay.virtual_stages)
            ]
            self._cache[key] = (out, per_layer)
        return self._cache[key]

    def model_state_bytes(self, n_params: float, dp: int, zero: int) -> dict[str, float]:
        pb, gb, ob = STATE_BYTES[self.dtype]
        return {
            "params": pb * n_params / (dp if zero >= 3 else 1),
            "grads": gb * n_params / (dp if zero >= 2 else 1),
            "optimizer": ob * n_params / (dp if zero >= 1 else 1),
        }

    def layer_activation_bytes(self, b: int, tp: int, sp: bool, ckpt: str) -> float:
        """Bytes one block keeps for backward per micro-batch of b sequences, per TP rank."""
        key = ("act", b, tp, sp, ckpt)
        if key in self._cache:
            return self._cache[key]
        s, e = self.shape, self.e
        d = 1 if s.dropout else 0
        sbh, bs = b * s.seq_len * s.hidden, b * s.seq_len
        repl = (4 * e + 2 * d) * sbh  # 2 norm inputs, 2 norm outputs, 2 dropout masks
        mlp = (3 if s.gated_mlp else 2) * e * bs * s.ffn
        shard = e * (2 * sbh + 2 * bs * s.kv_dim) + mlp  # Q, out-proj input, K, V, MLP
        if self.flash:
            core = 4 * b * s.heads * s.seq_len  # fp32 log-sum-exp per row
        else:
            sq = b * s.heads * s.seq_len**2
            core = (e + d + (e if d else 0)) * sq  # softmax (+ dropout mask and output)
        full = (repl / tp if sp else repl) + (shard + core) / tp
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
        s = self.shape
        b = s.global_batch // (lay.dp * lay.micro_batches)
        params, per_layer = self.rank_params(lay)
        per = self.layer_activation_bytes(b, lay.tp, lay.sequence_parallel, lay.checkpointing)
        bs = b * s.seq_len
        logits = (self.e + 4) * bs * s.padded_vocab(lay.tp) / lay.tp  # logits + fp32 softmax
        sp = lay.tp if lay.sequence_parallel else 1
        emb = (self.e + (1 if s.dropout else 0)) * bs * s.hidden / sp
        fkey = ("flight", lay.schedule, lay.pp, lay.micro_batches, lay.virtual_stages)
        send_out = self.e * bs * s.hidden / sp
        # gradients alive while one block runs backward: the MLP's inner gradient and two of
        # the residual stream (the saved tensors of that block are freed as it goes)
        work = self.e * (bs * s.ffn / lay.tp + 2 * bs * s.hidden)
        logits_grad = 4 * bs * s.padded_vocab(lay.tp) / lay.tp
        flight = self._cache.get(fkey)
        if flight is None:
            flight = self._cache[fkey] = in_flight(*fkey[1:])
        best: dict[str, float] = {}
        ranks = self.ranks(lay.pp, lay.virtual_stages)
        for r in self._heavy_ranks(lay.pp, lay.virtual_stages):
            blocks, has_e, has_h = ranks[r]
            mem = self.model_state_bytes(params[r], lay.dp, lay.zero)
            if lay.zero >= 3:  # the gathered block being used and the one being prefetched
                mem["params"] += 2 * per_layer * STATE_BYTES[self.dtype][0]
            # a rank that sends keeps each in-flight micro-batch's stage output until its
            # backward (the residual stream is not saved by autograd, the executor holds it)
            held = send_out if (lay.pp > 1 and not has_h) else 0.0
            act = flight[r] * (
                blocks * per + (emb if has_e else 0) + (logits if has_h else 0) + held
            )
            act += work if blocks else (logits_grad if has_h else 0.0)
            if lay.checkpointing == "full":  # one block's activations live during recompute
                act += self.layer_activation_bytes(b, lay.tp, lay.sequence_parallel, "none")
            mem["activations"] = act
            mem["total"] = mem["params"] + mem["grads"] + mem["optimizer"] + act
            if not best or mem["total"] > best["total"]:
                best = mem
        return best

    # ---------------------------------------------------------------- time ----------
    def _link(self, group: str, lay: Layout) -> Link:
        span = {"tp": lay.tp, "dp": lay.tp * lay.dp, "pp": lay.tp * lay.dp * lay.pp}[group]
        if group == "pp":  # neighbours are dp*tp ranks apart
            return self.profile.link(lay.tp * lay.dp >= self.gpn and lay.pp > 1)
        return self.profile.link(span > self.gpn)

    def layer_times(self, b: int, lay: Layout) -> dict[str, float]:
        """Seconds of one block per micro-batch on one rank (uncontended)."""
        key = ("lt", b, lay.tp, lay.sequence_parallel, lay.checkpointing, lay.dp, lay.zero)
        if key in self._cache:
            return self._cache[key]
        s, p, t = self.shape, self.profile, lay.tp
        gemm, core = s.layer_flops_fwd(b * s.seq_len)
        t_gemm, t_core = gemm / t / self.rate, core / t / self.rate
        none_bytes = self.layer_activation_bytes(b, t, lay.sequence_parallel, "none")
        t_elem = 2 * none_bytes / p.memory_bandwidth
        t_ops = OPS_PER_LAYER_FWD * p.op_overhead_s
        fwd = t_gemm + t_core + t_elem + t_ops
        bwd = 2 * (t_gemm + t_core + t_elem + t_ops)
        if lay.checkpointing == "full":
            bwd += fwd
        elif lay.checkpointing == "selective":
            bwd += t_core
        tp_f = tp_b = 0.0
        if t > 1:
            link = self._link("tp", lay)
            msg = self.e * b * s.seq_len * s.hidden
            if lay.sequence_parallel:
                one = collective_time("all_gather", msg, t, link) + collective_time(
                    "reduce_scatter", msg, t, link
                )
            else:
                one = collective_time("all_reduce", msg, t, link)
            # forward: 2 per block, each overlapped with the row-parallel GEMM (chunked)
            row_gemm = (
                t_gemm * (s.hidden + s.ffn) / (s.hidden + 2 * s.kv_dim + s.hidden + 2 * s.ffn)
            )
            hidden = min(one, row_gemm) * link.overlap * (OVERLAP_CHUNKS - 1) / OVERLAP_CHUNKS
            tp_f, tp_b = 2 * one - 2 * hidden, 2 * one  # backward: not overlapped
        z3_f = z3_b = 0.0
        if lay.zero >= 3 and lay.dp > 1:
            _, per_layer = self.rank_params(lay)
            link = self._link("dp", lay)
            nbytes = per_layer * STATE_BYTES[self.dtype][0]
            ag = collective_time("all_gather", nbytes, lay.dp, link)
            z3_f = max(0.0, ag - link.overlap * fwd)
            z3_b = max(0.0, ag - link.overlap * bwd)
        out = dict(
            fwd=fwd, bwd=bwd, w=t_gemm, tp_f=tp_f, tp_b=tp_b, z3_f=z3_f, z3_b=z3_b, gemm=t_gemm
        )
        self._cache[key] = out
        return out

    def rank_times(self, lay: Layout) -> tuple[list[float], ...]:
        """Forward, backward, weight-gradient and (inside those) TP/ZeRO-3 communication
        seconds of one micro-batch per pipeline rank."""
        s, p = self.shape, self.profile
        b = s.global_batch // (lay.dp * lay.micro_batches)
        key = (
            "rt",
            b,
            lay.tp,
            lay.sequence_parallel,
            lay.checkpointing,
            lay.dp,
            lay.zero,
            lay.pp,
            lay.virtual_stages,
        )
        if key in self._cache:
            return self._cache[key]
        lt = self.layer_times(b, lay)
        bs, v_pad = b * s.seq_len, s.padded_vocab(lay.tp)
        head_gemm = 2 * bs * s.hidden * v_pad / lay.tp / self.rate
        head = head_gemm + 3 * 4 * bs * v_pad / lay.tp / p.memory_bandwidth + 4 * p.op_overhead_s
        emb = 2 * self.e * bs * s.hidden / p.memory_bandwidth + 2 * p.op_overhead_s
        tf, tb, tw, tc = [], [], [], []
        for blocks, has_e, has_h in self.ranks(lay.pp, lay.virtual_stages):
            ex = (emb if has_e else 0.0) + (head if has_h else 0.0)
            tf.append(blocks * (lt["fwd"] + lt["tp_f"] + lt["z3_f"]) + ex)
            tb.append(blocks * (lt["bwd"] + lt["tp_b"] + lt["z3_b"]) + 2 * ex)
            tw.append(blocks * lt["gemm"] + (head_gemm if has_h else 0.0))
            tc.append(blocks * (lt["tp_f"] + lt["tp_b"] + lt["z3_f"] + lt["z3_b"]))
        self._cache[key] = (tf, tb, tw, tc)
        return tf, tb, tw, tc

    def _tail(self, lay: Layout, tb: list[float]) -> tuple[float, float, float, float]:
        """After a rank's last backward: the exposed part of the bucketed DP reduction
        (overlapped with that backward), the ZeRO-1/2 all-gather of the updated shards and
        the optimizer step; the slowest rank's (total, reduction, gather, optimizer)."""
        params, _ = self.rank_params(lay)
        best = (0.0, 0.0, 0.0, 0.0)
        for r in self._heavy_ranks(lay.pp, lay.virtual_stages):
            n_params = params[r]
            red = ag = 0.0
            if lay.dp > 1:
                link = self._link("dp", lay)
                gbytes = STATE_BYTES[self.dtype][1] * n_params
                kind = "reduce_scatter" if lay.zero >= 2 else "all_reduce"
                red = collective_time(kind, gbytes, lay.dp, link)
                n_buckets = max(1, math.ceil(gbytes / self.bucket_bytes))
                red = max(red - link.overlap * tb[r], red / n_buckets)
                if lay.zero in (1, 2):
                    nbytes = STATE_BYTES[self.dtype][0] * n_params
                    ag = collective_time("all_gather", nbytes, lay.dp, link)
            opt = n_params / (lay.dp if lay.zero >= 1 else 1) * 32 / self.profile.memory_bandwidth
            if red + ag + opt > best[0]:
                best = (red + ag + opt, red, ag, opt)
        return best

    def step_time(self, lay: Layout) -> tuple[float, dict[str, float]]:
        s, p = self.shape, self.profile
        b = s.global_batch // (lay.dp * lay.micro_batches)
        m = lay.micro_batches
        lt = self.layer_times(b, lay)
        tf, tb, tw, tc = self.rank_times(lay)
        t_comm = 0.0
        if lay.pp > 1:
            msg = self.e * b * s.seq_len * s.hidden / (lay.tp if lay.sequence_parallel else 1)
            t_comm = collective_time("p2p", msg, 2, self._link("pp", lay))
        pipe = pipeline_time(
            lay.schedule, lay.pp, m, lay.virtual_stages, tf, tb, tw, t_comm, self.simulator
        )
        tail, dp_exp, zero_ag, t_opt = self._tail(lay, tb)
        step = pipe + tail + p.step_overhead_s
        if p.cores:  # ranks share the cores: the busy time of all of them must fit too
            per_stage = self.ranks_per_host / lay.pp
            # waiting on a rate-limited wire leaves the cores to the other ranks
            cpu_comm = 1.0 if self._link("tp", lay).uses_cpu else 0.0
            busy = [f + b_ - (1.0 - cpu_comm) * c for f, b_, c in zip(tf, tb, tc, strict=True)]
            work = per_stage * m * sum(busy)
            # TP/ZeRO-3 ranks wait on the wire in lockstep: that wait adds to the shared work
            wire = (1.0 - cpu_comm) * m * max(tc)
            step = max(step, work / p.cores + wire + tail + p.step_overhead_s)
        blocks = max(r[0] for r in self.ranks(lay.pp, lay.virtual_stages))
        parts = dict(
            step=step,
            compute=m * (max(tf) + max(tb)),
            pipeline=pipe,
            tp_comm=m * blocks * (lt["tp_f"] + lt["tp_b"]),
            pp_p2p=t_comm,
            dp_comm=dp_exp,
            zero_comm=zero_ag + m * blocks * (lt["z3_f"] + lt["z3_b"]),
            optimizer=t_opt,
        )
        return step, parts

    def evaluate(self, lay: Layout) -> Estimate:
        est = Estimate(lay, memory=self.memory(lay))
        step, parts = self.step_time(lay)
        est.step_time_s, est.time = step, parts
        est.mfu = self.shape.model_flops_per_step() / (step * self.world * self.peak)
        return est
