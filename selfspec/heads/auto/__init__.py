"""`auto`: one tree merged from several drafters (its sources), weighted by what each has been accepting.

Every step each source that is paying its way proposes its own tree. The trees are merged into one trie over token
paths (a path two sources propose becomes one path). A node's score estimates its chance of being accepted: for a
source, the product down the path of that source's acceptance rates per depth and sibling rank, running estimates
from what the verifier accepted in this request (a depth not tried yet starting from the one above: rates.py); a node
keeps the best score any source gave it. The best n nodes
(n from the cost curve in use: expected accepted tokens per unit of verification cost) are verified as one tree of
deterministic candidates, so the verifier's rules keep the output exactly the target's.

After the step every source observes the committed tokens and hidden states as usual, with its own tree and the
part of the accepted path that lay in its own tree, so its caches and statistics stay its own whichever source's
path won. Each source is paced by the wrapper every drafter is paced by (`Paced`, heads/paced.py): a source whose
earned tokens (the accepted ones no other source proposed) fall below its drafting time, in plain target steps, is
skipped for a while in proportion to the time it lost, so a free source such as prompt lookup keeps drafting while a
costly head rests; `auto` as a whole is never paused. Skipped sources still observe every step.

Modules: merging.py (the merged tree, the way back to each source's own), rates.py (the acceptance estimates),
sources.py (which sources join, and what each earned for its pacing), drafter.py (the options and the drafter).
"""

from .drafter import AutoDrafter, AutoOptions
from .merging import merge_trees, own_accepted_path, select_nodes
from .rates import SourceRates
from .sources import DEFAULT_SOURCES, MIN_HELDOUT_TAU

__all__ = [
    "AutoDrafter",
    "AutoOptions",
    "DEFAULT_SOURCES",
    "MIN_HELDOUT_TAU",
    "SourceRates",
    "merge_trees",
    "own_accepted_path",
    "select_nodes",
]
