"""ZeRO-3's part of a layout's step time (:class:`Zero3Times`, a base of
:class:`~distllm.plan.timing.TimeModel`): each unit's all-gather before its forward and its
backward, prefetched behind the previous unit's compute, and the reduce-scatter of its
gradients, per pipeline rank, with the unit the engine keeps gathered from its forward to
its backward gathered once."""

from __future__ import annotations

from .collectives import collective_time
from .layout import Layout

__all__ = ["Zero3Times"]


class Zero3Times:
    """ZeRO-3's gathers and reduce-scatters of a :class:`~distllm.plan.timing.TimeModel`
    (which provides the links, the block times and the per-rank units)."""

    def _z3_unit(self, n: float, lay: Layout, hide_f: float, hide_b: float,
                 kept: bool = False) -> tuple[float, float, float]:
        """ZeRO-3 seconds of a gathered unit of ``n`` parameters per micro-batch, those not
        hidden: its all-gather before forward (prefetched behind ``hide_f`` seconds of
        compute), its all-gather before backward (behind ``hide_b``), and what the
        reduce-scatter of its gradients adds: they are reduce-scattered in the backward that
        completes them (every micro-batch's, or only the last one's when they accumulate in
        full buffers), on the same wire as the next unit's gather. ``kept``: the unit stays
        gathered from its forward to its backward (:meth:`z3_kept`): no gather before the
        backward, and its reduce-scatter alone on that wire."""
        if lay.zero < 3 or lay.dp == 1:
            return 0.0, 0.0, 0.0
        link = self._link("dp", lay)
        ag = collective_time("all_gather", n * self.param_bytes, lay.dp, link)
        f = max(0.0, ag - link.overlap * hide_f)
        rs = collective_time("reduce_scatter", n * self.grad_bytes, lay.dp, link)
        if kept:
            return f, 0.0, max(0.0, rs - link.overlap * hide_b)
        b = max(0.0, ag - link.overlap * hide_b)
        return f, b, max(0.0, ag + rs - link.overlap * hide_b) - b

    @staticmethod
    def z3_kept(lay: Layout, blocks: int, has_e: bool, has_h: bool) -> str | None:
        """The unit of a pipeline rank (``"head"``, ``"block"`` or ``"embedding"``) that
        ZeRO-3 gathers once per micro-batch instead of twice, or None. The engine keeps the
        last unit of a forward gathered: backward starts with it
        (``distllm.parallel.data.zero3.ShardedParams._post_forward``). A rank running one
        chunk (no pipeline, 1F1B, GPipe) so issues ``2 * units - 1`` gathers per micro-batch
        (tiny GPT dp4 m2: 22 a step; pp2 1F1B m4 and GPipe m2, 3 units a rank: 20 and 10).
        With several chunks a rank (interleaved) it issues at least ``2 * units`` (the same
        pp2 with v = 2: 12 to 13 at m 2, 26 to 27 at m 4): none is kept there."""
        if lay.zero < 3 or lay.dp == 1 or (lay.pp > 1 and lay.virtual_stages > 1):
            return None
        return "head" if has_h else "block" if blocks else "embedding" if has_e else None

    def z3_gathers(self, lay: Layout) -> list[int]:
        """ZeRO-3 all-gathers per step of each pipeline rank in forward-backward: each unit
        (block, embedding, head) before its forward and its backward, every micro-batch,
        less the kept unit's backward ones (:meth:`z3_kept`)."""
        if lay.zero < 3 or lay.dp == 1:
            return [0] * lay.pp
        return [lay.micro_batches * (2 * (blocks + has_e + has_h)
                                     - (self.z3_kept(lay, blocks, has_e, has_h) is not None))
                for blocks, has_e, has_h in self.ranks(lay.pp, lay.virtual_stages)]

    def z3_ranks(self, lay: Layout) -> list[tuple[float, float, float]]:
        """ZeRO-3 seconds per micro-batch of each pipeline rank's units, those not hidden
        (forward gathers, backward gathers, what the reduce-scatters add): its blocks', and
        the embedding's and the head's, gathered and reduce-scattered like a block. The
        embedding is a forward's first unit (nothing runs before its gather) and its
        backward's last (prefetched behind a block's); the head is the other way round. The
        kept unit (:meth:`z3_kept`) has no gather before its backward."""
        b = self.shape.global_batch // (lay.dp * lay.micro_batches)
        key = ("z3", b, lay.tp, lay.sequence_parallel, lay.checkpointing, lay.dp, lay.zero,
               lay.pp, lay.virtual_stages)
        if key not in self._cache:
            lt = self.layer_times(b, lay)
            emb_n, head_n = self.end_params(lay)
            # (parameters, hidden behind in forward, in backward) of each kind of unit
            units = {
                "embedding": (emb_n, 0.0, lt["bwd"]),
                "head": (head_n, lt["fwd"], 0.0),
                "block": (self.rank_params(lay)[1], lt["fwd"], lt["bwd"]),
            }
            unit = {k: (self._z3_unit(n, lay, hf, hb), self._z3_unit(n, lay, hf, hb, True))
                    for k, (n, hf, hb) in units.items()}
            out = []
            for blocks, has_e, has_h in self.ranks(lay.pp, lay.virtual_stages):
                count = {"block": blocks, "embedding": int(has_e), "head": int(has_h)}
                kept = self.z3_kept(lay, blocks, has_e, has_h)
                # each unit gathered twice, but the kept one
                out.append(tuple(
                    sum((count[k] - (k == kept)) * twice[i] + (k == kept) * once[i]
                        for k, (twice, once) in unit.items())
                    for i in range(3)))
            self._cache[key] = out
        return self._cache[key]
