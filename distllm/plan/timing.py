"""Step time of a layout: kernels per block (:mod:`distllm.plan.kernels`), communication
(alpha-beta per link class), the pipeline schedule (:mod:`distllm.plan.bubble`), the
data-parallel reduction and the optimizer, with overlap credited only where the runtime
(:mod:`distllm.plan.runtime`) overlaps and only as far as the link's ``overlap`` allows.

Per block and micro-batch, on one TP rank:
  * forward: the four linear GEMMs by shape, the attention core (fused, or two batched GEMMs
    and the softmax/dropout over the scores), the elementwise kernels, per-operator host
    overhead (CPU profiles);
  * backward: input- and weight-gradient GEMMs, the attention core's backward, twice the
    elementwise bytes; full recomputation adds one forward (its all-reduces included),
    selective recomputation the attention core's;
  * tensor parallelism: two all-reduces of the ``(b, s, h)`` stream in forward and two in
    backward (an all-gather and a reduce-scatter each with sequence parallelism); the
    forward ones overlapped with the row-parallel GEMM when the runtime does so;
  * ZeRO-3: each unit's all-gather before its forward and its backward, prefetched behind
    the previous unit's compute (a block's, or nothing for the first unit of a pass), and
    the reduce-scatter of its gradients; the embedding and the head are units as a block.

On CPU profiles (``cores``), the step is also bounded by the cores: the compute of every
rank on the host, plus the CPU that gloo's threads spend on the collectives that overlap it
(:mod:`distllm.plan.comm_cpu`), over the cores, plus what waits on a link.
"""

from __future__ import annotations

import math

from .bubble import pipeline_lower_bound, pipeline_time
from .collectives import collective_time
from .comm_cpu import rank_collective_cpu
from .kernels import (
    CE_BYTES_PER_LOGIT,
    attention_times,
    block_elementwise_bytes,
    gemm_time,
    linear_gemms,
    linear_times,
    mem_time,
)
from .layout import Layout
from .zero3_times import Zero3Times

__all__ = ["TimeModel", "OVERLAP_CHUNKS", "OPS_PER_LAYER_FWD"]

OVERLAP_CHUNKS = 4  # chunks of the overlapped row-parallel GEMM + all-reduce
OPS_PER_LAYER_FWD = 24  # eager operators of one block's forward (norms, GEMMs, attention, ...)


class TimeModel(Zero3Times):
    """The time half of :class:`distllm.plan.cost.CostModel` (which provides the shapes,
    the profile, the runtime, the stage split and the per-rank parameter counts)."""

    def _link(self, group: str, lay: Layout):
        """The link class of a group's transfers: ``inter`` where any group of that kind has
        ranks on two nodes. Ranks are ordered TP fastest, then DP, then PP
        (:mod:`distllm.parallel.mesh`), ``gpn`` to a node; the slowest group sets the pace."""
        return self.profile.link(self._crosses(group, lay.tp, lay.dp, lay.pp))

    def _crosses(self, group: str, tp: int, dp: int, pp: int) -> bool:
        key = ("crosses", group, tp, dp, pp)
        if key not in self._cache:
            g = self.gpn
            if group == "pp":  # rank r's neighbour in the next stage is r + tp*dp
                out = any(r // g != (r + tp * dp) // g for r in range((pp - 1) * tp * dp))
            elif group == "dp":  # ranks s*tp*dp + d*tp + t over d: first and last node
                out = dp > 1 and any(
                    (s * tp * dp + t) // g != (s * tp * dp + (dp - 1) * tp + t) // g
                    for s in range(pp) for t in range(tp)
                )
            else:
                out = tp > g
            self._cache[key] = out
        return self._cache[key]

    def _tp_collective(self, nbytes: float, lay: Layout) -> float:
        """One TP synchronisation point of ``nbytes`` (all-reduce, or AG + RS under SP)."""
        if lay.tp == 1:
            return 0.0
        link = self._link("tp", lay)
        if lay.sequence_parallel:
            return collective_time("all_gather", nbytes, lay.tp, link) + collective_time(
                "reduce_scatter", nbytes, lay.tp, link
            )
        return collective_time("all_reduce", nbytes, lay.tp, link)

    def _tp_times(self, tokens: int, lay: Layout) -> tuple[float, float]:
        """(forward, backward) seconds of a block's TP collectives not hidden by compute:
        two in forward (overlapped with the row-parallel GEMMs where the runtime does so),
        two in backward, and the forward's again when backward recomputes it."""
        if lay.tp == 1:
            return 0.0, 0.0
        s, p = self.shape, self.profile
        one = self._tp_collective(self.e * tokens * s.hidden, lay)
        hidden = 0.0
        if self.runtime.tp_overlap:  # each hidden behind its row-parallel GEMM, chunked
            gemms = linear_gemms(s, tokens, lay.tp)
            row = [gemm_time(p, self.peak, *gemms[i], elem=self.e) for i in (1, 3)]
            chunks = (OVERLAP_CHUNKS - 1) / OVERLAP_CHUNKS
            hidden = sum(min(one, r) for r in row) * self._link("tp", lay).overlap * chunks
        tp_f = 2 * one - hidden
        return tp_f, 2 * one + (tp_f if lay.checkpointing == "full" else 0.0)

    def layer_times(self, b: int, lay: Layout) -> dict[str, float]:
        """Seconds of one block per micro-batch on one rank (uncontended)."""
        key = ("lt", b, lay.tp, lay.sequence_parallel, lay.checkpointing, lay.dp, lay.zero,
               lay.pp)  # pp: whether a DP group straddles a node (_link)
        if key in self._cache:
            return self._cache[key]
        s, p, t, rt = self.shape, self.profile, lay.tp, self.runtime
        tokens = b * s.seq_len
        lin_f, lin_dg, lin_wg = linear_times(p, self.peak, s, tokens, t, self.e)
        att_f, att_b = attention_times(
            p, self.peak, s, b, t, self.e, self.flash, rt.causal_skip
        )
        gelu_f, gelu_b = (tokens * s.ffn / t * x for x in p.gelu_s_per_element)
        timed = gelu_f + gelu_b > 0  # the GeLU timed per element, not by its bytes
        elem = mem_time(p, block_elementwise_bytes(s, tokens, t, lay.sequence_parallel, self.e,
                                                   gelu=not timed))
        ops = OPS_PER_LAYER_FWD * p.op_overhead_s
        fwd = lin_f + att_f + elem + gelu_f + ops
        bwd = lin_dg + lin_wg + att_b + 2 * (elem + ops) + gelu_b
        recompute = {"full": fwd, "selective": att_f}.get(lay.checkpointing, 0.0)
        tp_f, tp_b = self._tp_times(tokens, lay)
        # prefetched behind the previous block's forward and the next one's backward
        z3_f, z3_b, z3_rs = self._z3_unit(self.rank_params(lay)[1], lay, fwd, bwd + recompute)
        out = dict(
            fwd=fwd,
            bwd=bwd + recompute,
            recompute=recompute,
            gemm=lin_f + lin_dg + lin_wg,
            attention=att_f + att_b,
            elementwise=3 * elem + gelu_f + gelu_b,
            w=self._deferred_wgrad(tokens, lay),
            tp_f=tp_f,
            tp_b=tp_b,
            z3_f=z3_f,
            z3_b=z3_b,
            z3_rs=z3_rs,
        )
        self._cache[key] = out
        return out

    def _deferred_wgrad(self, tokens: int, lay: Layout) -> float:
        """Seconds of a block's weight-gradient GEMMs that zb-h1's W runs (the rest run in B),
        for the parts :meth:`Runtime.zb_deferred` names."""
        s, t = self.shape, lay.tp
        parts = self.runtime.zb_deferred(t, s.splits_vocab(t, lay.sequence_parallel))
        gemms = linear_gemms(s, tokens, t)  # QKV, projection, MLP input, MLP output
        wanted = gemms[:2] * ("attention" in parts) + gemms[2:] * ("mlp" in parts)
        return sum(gemm_time(self.profile, self.peak, k, n, m, elem=self.e)
                   for m, n, k in wanted)

    def _ends(self, b: int, lay: Layout) -> tuple[float, ...]:
        """(embedding forward, embedding backward, head forward, head backward, head
        weight-gradient) seconds, and the TP collectives inside them: (embedding's, head's;
        see :meth:`_end_collectives`). A vocabulary held whole
        (:meth:`ModelShape.splits_vocab`) has none of them, and every TP rank computes the
        whole head."""
        s, p, t = self.shape, self.profile, lay.tp
        tokens = b * s.seq_len
        n = tokens * s.hidden
        split = s.splits_vocab(t, lay.sequence_parallel)  # whole: no collective at all
        m, vn = tokens, s.vocab_rows(t, lay.sequence_parallel)
        head_f = gemm_time(p, self.peak, m, vn, s.hidden, elem=self.e)  # (T, h) @ (h, V/t)
        head_dg = gemm_time(p, self.peak, m, s.hidden, vn, elem=self.e)
        head_w = gemm_time(p, self.peak, s.hidden, vn, m, elem=self.e)
        ce = mem_time(p, CE_BYTES_PER_LOGIT * tokens * vn)
        norm = mem_time(p, 4 * self.e * n) + 3 * p.op_overhead_s
        fwd_c, bwd_c, ce_c = self._end_collectives(tokens, lay) if split else (0.0, 0.0, 0.0)
        work = mem_time(p, 4 * self.e * n) + 2 * p.op_overhead_s
        # the embedding: (all-reduce | reduce-scatter) forward, (nothing | all-gather) backward
        emb_f, emb_b = work + fwd_c, work + bwd_c
        # the head: (nothing | all-gather) forward, (all-reduce | reduce-scatter) backward
        head_fwd = head_f + ce / 2 + norm + ce_c + bwd_c
        head_bwd = head_dg + head_w + ce / 2 + 2 * norm + fwd_c
        if "head" not in self.runtime.zb_deferred(t, split):
            head_w = 0.0  # its weight GEMM runs in B
        return emb_f, emb_b, head_fwd, head_bwd, head_w, fwd_c + bwd_c, ce_c + fwd_c + bwd_c

    def _end_collectives(self, tokens: int, lay: Layout) -> tuple[float, float, float]:
        """Seconds of one micro-batch's (all-reduce, or under sequence parallelism
        reduce-scatter; nothing, or all-gather; the loss's all-reduces) over TP. The embedding
        (``distllm.nn.VocabParallelEmbedding``) runs the first in forward and the second in
        backward, the head's column-parallel projection the other way round; the
        vocab-parallel cross-entropy all-reduces the per-token max, then the stacked per-token
        sum and target logit (fp32), in forward (``distllm.nn.cross_entropy``)."""
        if lay.tp == 1:
            return 0.0, 0.0, 0.0
        link, msg = self._link("tp", lay), self.e * tokens * self.shape.hidden
        ce = sum(collective_time("all_reduce", k * 4 * tokens, lay.tp, link) for k in (1, 2))
        if lay.sequence_parallel:
            return (collective_time("reduce_scatter", msg, lay.tp, link),
                    collective_time("all_gather", msg, lay.tp, link), ce)
        return collective_time("all_reduce", msg, lay.tp, link), 0.0, ce

    def rank_times(self, lay: Layout) -> tuple[list[float], ...]:
        """Forward, backward, weight-gradient and (inside those) TP/ZeRO-3 communication
        seconds of one micro-batch per pipeline rank."""
        s = self.shape
        b = s.global_batch // (lay.dp * lay.micro_batches)
        key = ("rt", b, lay.tp, lay.sequence_parallel, lay.checkpointing, lay.dp, lay.zero,
               lay.pp, lay.virtual_stages)
        if key in self._cache:
            return self._cache[key]
        lt = self.layer_times(b, lay)
        emb_f, emb_b, head_f, head_b, head_w, emb_c, head_c = self._ends(b, lay)
        tf, tb, tw, tc = [], [], [], []
        for (blocks, has_e, has_h), (z3_f, z3_b, _) in zip(
                self.ranks(lay.pp, lay.virtual_stages), self.z3_ranks(lay), strict=True):
            tf.append(blocks * (lt["fwd"] + lt["tp_f"]) + z3_f
                      + (emb_f if has_e else 0.0) + (head_f if has_h else 0.0))
            tb.append(blocks * (lt["bwd"] + lt["tp_b"]) + z3_b
                      + (emb_b if has_e else 0.0) + (head_b if has_h else 0.0))
            tw.append(blocks * lt["w"] + (head_w if has_h else 0.0))
            tc.append(blocks * (lt["tp_f"] + lt["tp_b"]) + z3_f + z3_b
                      + (emb_c if has_e else 0.0) + (head_c if has_h else 0.0))
        self._cache[key] = (tf, tb, tw, tc)
        return tf, tb, tw, tc

    def p2p_time(self, lay: Layout) -> float:
        """One pipeline message (a micro-batch's activation or its gradient) between stages."""
        if lay.pp == 1:
            return 0.0
        s = self.shape
        b = s.global_batch // (lay.dp * lay.micro_batches)
        full = self.e * b * s.seq_len * s.hidden
        if lay.sequence_parallel:
            return collective_time("p2p", full / lay.tp, 2, self._link("pp", lay))
        if self.runtime.p2p_scatter_gather and lay.tp > 1:  # send 1/t, all-gather on NVLink
            return collective_time("p2p", full / lay.tp, 2, self._link("pp", lay)) + (
                collective_time("all_gather", full, lay.tp, self._link("tp", lay))
            )
        return collective_time("p2p", full, 2, self._link("pp", lay))

    def pipeline_bound(self, lay: Layout) -> float:
        """Seconds the forward+backward part of ``lay``'s step takes at least, by the closed
        form or by the simulator (:func:`distllm.plan.bubble.pipeline_lower_bound`): the step
        of :meth:`step_time` with this in place of its ``pipeline`` term is a lower bound."""
        tf, tb, _, _ = self.rank_times(lay)
        return pipeline_lower_bound(lay.schedule, lay.pp, lay.micro_batches, lay.virtual_stages,
                                    tf, tb, self.p2p_time(lay))

    def _tail(self, lay: Layout, tb: list[float]) -> tuple[float, float, float, float]:
        """After a rank's last backward: the exposed part of the DP gradient reduction (with
        ``dp_overlap``, overlapped with that backward), the ZeRO-1/2 all-gather of the
        updated shards and the optimizer step; the slowest rank's (total, reduction,
        gather, optimizer)."""
        params, _ = self.rank_params(lay)
        rt, best = self.runtime, (0.0, 0.0, 0.0, 0.0)
        for r in self._heavy_ranks(lay.pp, lay.virtual_stages):
            n_params = params[r]
            red = ag = 0.0
            if lay.dp > 1 and lay.zero >= 3:  # per unit, inside backward (z3_ranks)
                once = rt.zero_grad_accumulation == "full"
                red = (1 if once else lay.micro_batches) * self.z3_ranks(lay)[r][2]
            elif lay.dp > 1:
                link = self._link("dp", lay)
                gbytes = self.grad_bytes * n_params
                kind = "reduce_scatter" if lay.zero >= 2 else "all_reduce"
                red = collective_time(kind, gbytes, lay.dp, link)
                if rt.dp_overlap:
                    n_buckets = max(1, math.ceil(gbytes / self.bucket_bytes))
                    red = max(red - link.overlap * tb[r], red / n_buckets)
                if lay.zero in (1, 2):
                    nbytes = self.param_bytes * n_params
                    ag = collective_time("all_gather", nbytes, lay.dp, link)
            ranks = self.ranks(lay.pp, lay.virtual_stages)
            if self.shape.tied_embeddings and lay.pp > 1 and (ranks[r][1] or ranks[r][2]):
                # the first and last stages each hold the word embedding: its gradients
                # are summed between them once per step
                words = self.shape.vocab_rows(lay.tp, lay.sequence_parallel) * self.shape.hidden
                link = self.profile.link(lay.tp * lay.dp * lay.pp > self.gpn)
                red += collective_time("all_reduce", self.grad_bytes * words, 2, link)
            local = n_params / (lay.dp if lay.zero >= 1 else 1)
            opt = mem_time(self.profile, local * rt.optimizer_bytes)
            if red + ag + opt > best[0]:
                best = (red + ag + opt, red, ag, opt)
        return best

    def sync_time(self, lay: Layout) -> float:
        """The optimizer step's scalar all-reduces (runtime ``step_syncs``), each as long as
        its group's link makes an 8-byte all-reduce. One over the world group carries the
        gradient norm's squares and the loss (DDP), and ZeRO's inf/NaN flag with them (ZeRO
        over more than one DP rank); where ZeRO runs its checks one by one (a single DP rank,
        or stage 0 under bf16) the norm is reduced over the model-parallel group (TP x PP)
        and the flag and the loss each over the world."""
        if not self.runtime.step_syncs:
            return 0.0
        world = lay.tp * lay.pp * lay.dp
        ddp = lay.zero == 0 and self.dtype != "bfloat16"  # the engine's DDP path
        groups = [(world, world)]
        if not ddp and not (lay.zero >= 1 and lay.dp > 1):
            # the model-parallel group's ranks are tp*dp apart across stages
            span = lay.tp * lay.dp * lay.pp if lay.pp > 1 else lay.tp
            groups += [(lay.tp * lay.pp, span), (world, world)]
        return sum(collective_time("all_reduce", 8, n, self.profile.link(sp > self.gpn))
                   for n, sp in groups)

    def step_time(self, lay: Layout) -> tuple[float, dict[str, float]]:
        s, p = self.shape, self.profile
        b = s.global_batch // (lay.dp * lay.micro_batches)
        m = lay.micro_batches
        lt = self.layer_times(b, lay)
        tf, tb, tw, tc = self.rank_times(lay)
        t_comm = self.p2p_time(lay)
        pipe = pipeline_time(
            lay.schedule, lay.pp, m, lay.virtual_stages, tf, tb, tw, t_comm, self.simulator
        )
        tail, dp_exp, zero_ag, t_opt = self._tail(lay, tb)
        sync = self.sync_time(lay)
        step = pipe + tail + sync + p.step_overhead_s
        cpu_busy = 0.0
        if p.cores:  # ranks share the cores: the busy time of all of them must fit too
            per_stage = self.ranks_per_host / lay.pp
            # a link's collective times are measured with every rank of the host in the
            # collective at once (calibrate: all ranks on the cores): a lockstep TP/ZeRO-3
            # collective adds its time once, whether the wire or the cores (loopback) move
            # the bytes; the compute of all ranks shares the cores
            busy = [f + b_ - c for f, b_, c in zip(tf, tb, tc, strict=True)]
            # more ranks than cores: each rank's CPU time grows (caches, context switches)
            sharing = p.core_sharing if self.ranks_per_host > p.cores else 1.0
            work = per_stage * m * sum(busy) * sharing
            wire = m * max(tc)
            # every rank of the host runs its optimizer step at the same time, on the cores
            crowd = max(1.0, per_stage * lay.pp * sharing / p.cores)
            tail_cpu = tail + (crowd - 1.0) * t_opt
            opt_cpu = per_stage * lay.pp * sharing * t_opt
            coll = rank_collective_cpu(self, lay)
            lock, bg = (per_stage * sum(c[i] for c in coll) for i in (0, 1))
            # the lockstep (TP) collectives' link times were measured with every rank in
            # them at once, their CPU included; the background ones (DP reduction, ZeRO
            # gathers, pipeline messages) take their CPU from the compute they overlap
            step = max(step, (work + bg) / p.cores + wire + tail_cpu + sync
                       + p.step_overhead_s)
            # CPU seconds of all the host's ranks per step (what a loaded machine cannot
            # stretch): gloo's measured CPU, or for a profile without it the cores that a
            # lockstep TP collective on loopback holds for its time
            if lock + bg:
                link_cpu = lock + bg
            elif self._link("tp", lay).uses_cpu and lay.tp > 1:
                link_cpu = p.cores * wire
            else:
                link_cpu = 0.0
            cpu_busy = work + link_cpu + opt_cpu
        blocks = max(r[0] for r in self.ranks(lay.pp, lay.virtual_stages))
        zero3 = m * max(f + b_ for f, b_, _ in self.z3_ranks(lay))
        chunks = m * (lay.virtual_stages if lay.pp > 1 else 1)
        parts = dict(
            step=step,
            compute=m * (max(tf) + max(tb)),
            pipeline=pipe,
            bubble=max(0.0, pipe - m * max(f + b_ for f, b_ in zip(tf, tb, strict=True))),
            gemm=m * blocks * lt["gemm"],
            attention=m * blocks * lt["attention"],
            elementwise=m * blocks * lt["elementwise"],
            recompute=m * blocks * lt["recompute"],
            tp_comm=m * blocks * (lt["tp_f"] + lt["tp_b"]),
            pp_p2p=t_comm,
            pp_p2p_total=2 * chunks * t_comm if lay.pp > 1 else 0.0,
            dp_comm=dp_exp,
            zero_comm=zero_ag + zero3,
            zero3_gather=zero3,
            optimizer=t_opt,
            sync=sync,
            cpu_busy=cpu_busy,
        )
        return step, parts
