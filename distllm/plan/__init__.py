"""The planner: a cost model (memory, FLOPs, GEMMs by shape, alpha-beta communication,
pipeline bubble) of a training code (a runtime) on a hardware profile, a search over TP x PP x
DP x ZeRO x micro-batches x schedule x checkpointing, and a dry run of the real code on fake
tensors (:mod:`distllm.plan.dry_run`, ``distllm plan --verify``) that checks its memory.

Importing it needs neither torch.distributed nor a device::

    from distllm.plan import best_layout, preset
    layout, why = best_layout(preset("tiny"), world_size=4, gpus_per_node=4, profile="cpu")
"""

from .cost import CostModel, Estimate, Layout
from .hardware import Link, Profile, detect_profile, load_profile, profile_names
from .model import ModelShape, preset, preset_names
from .runtime import Runtime, runtime_names
from .search import SearchResult, best_layout, model_states_table, search

__all__ = [
    "best_layout",
    "search",
    "SearchResult",
    "CostModel",
    "Estimate",
    "Layout",
    "ModelShape",
    "preset",
    "preset_names",
    "Profile",
    "Runtime",
    "runtime_names",
    "Link",
    "load_profile",
    "profile_names",
    "detect_profile",
    "model_states_table",
]
