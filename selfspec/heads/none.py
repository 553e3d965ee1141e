"""`none`: no draft at all. Plain decoding through the same loop, verifier and cache code."""

from __future__ import annotations

from ..tree_attention import DraftTree
from .base import Drafter, DraftRequest, register_drafter


@register_drafter("none")
class NoDrafter(Drafter):
    def propose(self, request: DraftRequest) -> DraftTree:
        return DraftTree.root_only(request.root_token)
