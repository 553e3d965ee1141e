"""The tree as data, its mask and positions, the target forward over it, the verifier and KV-cache compaction."""

from .cache import CompactsInPlace, compact_cache, trim_cache
from .forward import ForwardOutput, chunk_forward, tree_forward
from .inputs import TreeInputs, ancestor_matrix, build_tree_inputs, causal_block_mask
from .tree import DraftTree
from .verifier import VerifyResult, verify

__all__ = [
    "CompactsInPlace",
    "DraftTree",
    "ForwardOutput",
    "TreeInputs",
    "VerifyResult",
    "ancestor_matrix",
    "build_tree_inputs",
    "causal_block_mask",
    "chunk_forward",
    "compact_cache",
    "tree_forward",
    "trim_cache",
    "verify",
]
