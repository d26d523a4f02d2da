"""Loss scaling for half-precision training: a constant scale, or a dynamic one that halves
on an inf/NaN gradient and doubles after a run of good steps (as ``torch.amp.GradScaler``)."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

__all__ = ["LossScaler"]

DYNAMIC_INIT = 2.0**16  # the first dynamic scale, as torch.amp.GradScaler's default
GROWTH_INTERVAL = 2000  # good steps in a row before a dynamic scale doubles


class LossScaler:
    """``loss_scale``: ``None`` (no scaling), a positive constant, or ``"dynamic"``.

    Attributes:
        scale: the current multiplier of the loss (1.0 when off).
        dynamic: whether :meth:`update` changes ``scale``.
    """

    def __init__(self, loss_scale: float | str | None) -> None:
        self.dynamic = loss_scale == "dynamic"
        try:
            constant = 1.0 if loss_scale is None or self.dynamic else float(loss_scale)
        except (TypeError, ValueError):
            constant = -1.0
        if not (constant > 0 and math.isfinite(constant)):
            raise ValueError(f"loss_scale={loss_scale!r}: use None, a finite positive number "
                             f"or 'dynamic'")
        self.scale = DYNAMIC_INIT if self.dynamic else constant
        self._good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"dynamic", "scale", "good_steps"}``: what a resumed run needs to scale (and grow
        the scale) as the uninterrupted one would."""
        return {"dynamic": self.dynamic, "scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` into a dynamic scaler. A scaler that is off or
        constant keeps its own scale (the optimizer's setting, not state), and so does a
        dynamic one given the state of one that was not dynamic; a state without
        ``good_steps`` (saved before it was kept) restarts the count of good steps."""
        if not self.dynamic or not state.get("dynamic", True):
            return
        if state.get("scale") is not None:
            self.scale = float(state["scale"])
        self._good_steps = int(state.get("good_steps", 0))

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss * scale`` (the loss itself when the scale is 1)."""
        return loss * self.scale if self.scale != 1.0 else loss

    def update(self, skipped: bool) -> None:
        """After a step: a dynamic scale halves (not below 1) when the step was skipped for an
        inf/NaN gradient, and doubles after ``GROWTH_INTERVAL`` good steps in a row."""
        if not self.dynamic:
            return
        if skipped:
            self.scale = max(self.scale / 2.0, 1.0)
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps % GROWTH_INTERVAL == 0:
                self.scale *= 2.0
