"""A recipe per drafter, one layout for each head: its training module (`<Head>Training`: the loss), the recipe the
drafter registers (`train_<drafter>(target, config, resume, max_steps, timings) -> report`; EAGLE and EAGLE-3 share
`train_eagle_family`), the check made before any data is (`check_eagle`, `check_medusa`) and a fresh head over the
labelled sample (`new_eagle_head`, `new_dflash_head`, `new_medusa_heads`), which `joint` reuses to train several heads
from one label pass. `layerskip` is the layer-skip draft's search (`selfspec tune layerskip`)."""
