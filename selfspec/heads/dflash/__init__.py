"""`dflash`: a small block-diffusion drafter that drafts a whole block in one pass (DFlash), in the layout of the
DFlash paper and of the speculators library, which vLLM loads (`selfspec export --format speculators`).

The block holds B positions: the last committed token (the anchor), then B - 1 copies of a mask token's embedding
(`mask_token_id`, a token the training data never uses). A few bidirectional decoder layers denoise it in one
forward: Qwen3 decoder layers (stock transformers modules, per-head q/k norms) of the target's width, whatever the
target's architecture. The drafter is conditioned on the target's hidden states from a low, a middle and a high
layer: concatenated, projected by `fc` and normalised (`hidden_norm`) into one context row per committed position.
Context rows are not queries: each layer projects them straight into extra keys and values beside the block's
(k_norm and RoPE at their own positions, no input norm), so they depend only on the target's features and stay in
the drafter's KV cache across steps; the block's keys and values are cropped after each proposal. A block row sees
every context row before the anchor and the whole block. The drafter shares the target's frozen embeddings and LM
head (restricted to a reduced draft vocabulary; its own final `norm`).

The block's per-position distributions become a tree: best-first over per-position top-k, each path scored by the
product of its tokens' marginal probabilities, kept up to the size that maximises expected accepted length per unit
of verification cost on this machine's cost curve.

Modules: head.py (config, the head, the training mask), drafter.py (options, the tree search, the drafter),
interop.py (the speculators format, both ways).
"""

from .drafter import DFlashDrafter, DFlashOptions, block_tree
from .head import MAX_LAYERS, DFlashConfig, DFlashHead, draft_layer_config, resolve_feature_layers, training_mask
from .interop import export_heads, import_heads, imported_artifact

__all__ = [
    "MAX_LAYERS",
    "DFlashConfig",
    "DFlashDrafter",
    "DFlashHead",
    "DFlashOptions",
    "block_tree",
    "draft_layer_config",
    "export_heads",
    "import_heads",
    "imported_artifact",
    "resolve_feature_layers",
    "training_mask",
]
